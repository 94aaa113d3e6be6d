"""The OpenAI-compatible HTTP server of `minisgl-run serve` (in progress).

`minisgl.server.protocol` holds its protocol layer: request bodies -> `SamplingParams`, engine results
-> OpenAI-shaped responses, streamed chunks and errors, as pure functions with no server or engine.
"""
