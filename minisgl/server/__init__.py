"""The HTTP server of `minisgl-run serve`: the OpenAI API (`/v1/completions`, `/v1/chat/completions`,
`/v1/models`) and SGLang's native one (`/generate` and what its router reads), in a front-end process
in front of scheduler processes (one, or `--dp N` replicas). `minisgl.server.app` assembles it and its
docstring lists the modules by what they own; docs/server.md describes the server. Only what serves
lives here: the serving benchmark, a client, is `minisgl.bench.serving`.
"""
