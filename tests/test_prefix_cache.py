"""The radix prefix cache in the scheduler (`cache_type: radix`, docs/prefix-cache.md): over prompts that
share prefixes, the outputs equal those of `cache_type: naive` (greedy and seeded, fp32, CPU) while the
shared prefixes are really found and skipped; with page sizes 1, 4 and 16, prefixes shorter than a page,
of exactly a page and longer, chunked prefill, overlap on and off, pools so small that the tree is
evicted and requests are preempted all the time, multi-turn conversations, aborts, random arrivals
(hypothesis), lockstep ranks and tensor parallelism; and every page and reference comes back."""

import random
from collections import Counter

import pytest
import torch
from conftest import FIXED_EXAMPLES, check_clean, llm_clean
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from minisgl import metrics
from minisgl.core import SamplingParams
from minisgl.engine import Engine, EngineConfig
from minisgl.llm import LLM
from minisgl.scheduler import Scheduler, SchedulerConfig

EOS = 2
POOL_TOKENS = 2400  # the KV pool of the "big" engines, in tokens: never evicted, never preempted


@pytest.fixture(scope="module")
def tiny_llama(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def engines(tiny_llama):
    """engines(page_size, num_pages=None, max_running_req=8): one engine per shape, built once; no
    num_pages: a pool of POOL_TOKENS tokens."""
    made: dict[tuple[int, int, int], Engine] = {}

    def get(page_size: int, num_pages: int | None = None, max_running_req: int = 8) -> Engine:
        key = (page_size, num_pages or POOL_TOKENS // page_size, max_running_req)
        if key not in made:
            made[key] = Engine(
                EngineConfig(
                    model_path=str(tiny_llama),
                    dtype=torch.float32,
                    device="cpu",
                    page_size=key[0],
                    num_page_override=key[1],
                    max_running_req=key[2],
                )
            )
        return made[key]

    yield get
    for engine in made.values():
        engine.shutdown()


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 320) for _ in range(n)]


BASES = [_tokens(100 + i, 96) for i in range(3)]  # the shared prefixes prompts are cut from


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def _params(kind: str, max_tokens: int, i: int) -> SamplingParams:
    if kind == "greedy":
        return _greedy(max_tokens)
    if kind == "seeded":
        return SamplingParams(
            max_tokens=max_tokens, temperature=0.8, top_k=50, seed=1000 + i, ignore_eos=True
        )
    # EOS may end it, after min_tokens
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, min_tokens=max_tokens // 2)


def _scheduler(
    engine: Engine, cache_type: str, overlap: bool = True, max_prefill_tokens: int = 512, **kw
) -> Scheduler:
    config = SchedulerConfig(
        max_prefill_tokens=max_prefill_tokens, overlap_scheduling=overlap, cache_type=cache_type
    )
    sched = Scheduler(engine, config, eos_token_ids=[EOS], **kw)
    assert (sched.prep.cache is None) == (cache_type == "naive")
    return sched


def _step(sched: Scheduler) -> None:
    sched.step()
    # the pages requests hold (their own and the tree's they reference) are at most those of their page
    # tables (where a shared prefix counts once per request); the tree's pages are all in use
    assert sched.prep.num_request_pages <= sched.held_pages
    assert sched.prep.pages.num_used <= sched.engine.num_pages
    sched.prep.check_pages()


def _run_schedule(sched: Scheduler, schedule, aborts=(), clears=(), freed: list | None = None) -> list:
    """Runs `schedule` ((arrival step, prompt, params), in arrival order) to the end, aborting request i
    at step s for each (s, i) in `aborts` and clearing the prefix cache before each step in `clears`
    (only what no running request uses goes; `freed` gets the pages each clear freed); returns the
    states in schedule order."""
    states: list = []
    pending, step = list(schedule), 0
    while pending or sched.has_work():
        while pending and pending[0][0] <= step:
            _, prompt, params = pending.pop(0)
            states.append(sched.add_request(prompt, params))
        for at, i in aborts:
            if at == step and i < len(states):
                sched.abort(states[i])
        if step in clears:
            cache = sched.prep.cache
            evictable, referenced = cache.num_evictable_pages, cache.num_referenced_pages
            assert sched.clear_prefix_cache() == evictable
            if freed is not None:
                freed.append(evictable)
            assert cache.num_pages == cache.num_referenced_pages == referenced
        _step(sched)
        step += 1
        assert step < 5000
    check_clean(sched)
    return states


def _outputs(states) -> list:
    return [(s.output_ids, s.finish_reason) for s in states]


def _lcp(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _expected_hit(prompt: list[int], computed: list[list[int]], page_size: int) -> int:
    """The tokens of `prompt` a tree holding the whole pages of every sequence in `computed` (and
    nothing evicted) must find: the longest common prefix of the prompt short of its last token with
    one of them, in whole pages."""
    best = max((_lcp(prompt[:-1], seq) for seq in computed), default=0)
    return best // page_size * page_size


def _computed(state) -> list[int]:
    """The tokens whose KV a finished greedy ignore_eos request computed: its prompt and its output
    but the last token (sampled, never fed back)."""
    return state.prompt_ids + state.output_ids[:-1]


def _clear_and_check_empty(sched: Scheduler) -> None:
    """With everything finished: the tree holds pages but no reference; clearing it returns them all."""
    check_clean(sched)
    cache = sched.prep.cache
    held = cache.num_pages
    assert cache.num_referenced_pages == 0 and sched.prep.pages.num_used == held
    assert sched.clear_prefix_cache() == held
    assert sched.prep.pages.num_used == 0 and cache.num_pages == 0 and cache.num_nodes == 0
    assert sched.prep.table_idxs.num_free == sched.engine.config.max_running_req
    sched.prep.check_pages()


def _metric(name: str, model_name: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, {"model_name": model_name}) or 0.0


_naive_runs: dict = {}


def _naive_alone(engine: Engine, prompt: list[int], params: SamplingParams) -> list:
    """(output ids, finish reason) of the request alone on `engine` without a prefix cache."""
    key = (id(engine), tuple(prompt), params)
    if key not in _naive_runs:
        sched = _scheduler(engine, "naive", overlap=False)
        [state] = _run_schedule(sched, [(0, prompt, params)])
        _naive_runs[key] = (state.output_ids, state.finish_reason)
    return _naive_runs[key]


# -- prefixes around a page, one request at a time ---------------------------------------------------


def _around_a_page(page_size: int) -> list[list[int]]:
    """Prompts cut from BASES[0]: the first one caches several pages, the others share less than a
    page, exactly one, one and a token, several, several and some, the first prompt again, a prompt made
    only of cached whole pages, a single token."""
    base, ps = BASES[0], page_size
    first = base[: 3 * ps + 5] + _tokens(1, 4)
    return [
        first,
        base[: ps - 1] + _tokens(2, 5),
        base[:ps] + _tokens(3, 5),
        base[: ps + 1] + _tokens(4, 3),
        base[: 3 * ps] + _tokens(5, 6),
        base[: 3 * ps + 2] + _tokens(6, 2),
        list(first),
        base[: 2 * ps],
        base[:1],
    ]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_shared_prefixes_one_at_a_time_hit_exactly_and_equal_naive(engines, page_size, overlap):
    """Each request runs alone after the others: it finds exactly the longest prefix, in whole pages
    short of its last token, that earlier requests computed; it prefills only the rest, and its tokens
    are naive's."""
    engine = engines(page_size)
    prompts = _around_a_page(page_size)
    schedule = [(0, p, _greedy(6)) for p in prompts]
    naive = _scheduler(engine, "naive", overlap=overlap)
    radix = _scheduler(engine, "radix", overlap=overlap, record_steps=1000)
    expected_states = [_run_schedule(naive, [spec])[0] for spec in schedule]
    computed: list[list[int]] = []
    hits = []
    for spec, ref in zip(schedule, expected_states):
        [state] = _run_schedule(radix, [spec])
        assert (state.output_ids, state.finish_reason) == (ref.output_ids, ref.finish_reason), state.uid
        expected = _expected_hit(spec[1], computed, page_size)
        assert state.prefix_found == expected, (state.uid, len(spec[1]))
        # the prefill computed the rest of the prompt only (one chunk: max_prefill_tokens 512)
        prefill = [r for r in radix.step_records if r.phase == "prefill"][-1]
        assert prefill.num_tokens == len(spec[1]) - expected
        hits.append(expected)
        computed.append(_computed(state))
    assert radix.prefix_evicted_pages == 0 and radix.preemptions == 0
    assert radix.prefix_lookup_tokens == sum(len(p) for p in prompts)
    assert radix.prefix_cached_tokens == sum(hits) > 0
    assert naive.prefix_cached_tokens == 0 and naive.prefix_lookup_tokens == sum(len(p) for p in prompts)
    ps = page_size
    # shorter than a page: nothing (page_size 1: the prompt shares nothing); a page, a page and one
    assert hits[1] == 0 and hits[2] == ps and hits[3] == (ps + 1) // ps * ps
    assert hits[6] == (len(prompts[0]) - 1) // ps * ps  # the same prompt again
    assert hits[7] == (2 * ps - 1) // ps * ps  # all cached: its last token is computed all the same
    assert hits[8] == 0
    _clear_and_check_empty(radix)


# -- requests together: chunked prefill, overlap, same-step twins ------------------------------------


def _together_schedule(seed: int) -> list:
    """Requests arriving at steps 0, 3 and 9 over two long shared prefixes (40 and 33 tokens), so that
    small prefill budgets cut the shared part into chunks; request 2 repeats request 0."""
    a, b = BASES[1][:40], BASES[2][:33]
    specs = [
        (0, a + _tokens(seed, 6), 8),
        (0, a + _tokens(seed + 1, 3), 5),
        (0, None, 7),  # request 0's prompt again, admitted in the same step
        (0, b + _tokens(seed + 2, 9), 6),
        (3, a[:29] + _tokens(seed + 3, 2), 9),
        (3, b + _tokens(seed + 4, 1), 4),
        (9, a + _tokens(seed + 5, 11), 6),
        (9, b[:20], 3),
    ]
    schedule = []
    for step, prompt, n in specs:
        schedule.append((step, list(schedule[0][1]) if prompt is None else prompt, _greedy(n)))
    return schedule


@pytest.mark.parametrize(
    ("page_size", "budget", "overlap"),
    [(4, 8, False), (4, 8, True), (1, 7, True), (16, 24, False), (4, 512, True), (16, 512, False)],
)
def test_requests_together_with_chunked_prefill_equal_naive(engines, page_size, budget, overlap):
    """Requests arriving together and later over shared prefixes that small budgets prefill in chunks:
    the outputs of the same schedule without a prefix cache, and the prefixes are shared."""
    engine = engines(page_size)
    schedule = _together_schedule(7)
    naive = _run_schedule(_scheduler(engine, "naive", overlap=overlap, max_prefill_tokens=budget), schedule)
    sched = _scheduler(engine, "radix", overlap=overlap, max_prefill_tokens=budget)
    states = _run_schedule(sched, schedule)
    assert _outputs(states) == _outputs(naive)
    assert all(s.finish_reason == "length" for s in states)
    assert 0 < sched.prefix_cached_tokens < sched.prefix_lookup_tokens
    assert sched.prefix_lookup_tokens == sum(len(p) for _, p, _ in schedule)
    # the late arrivals start their prefill after the early ones' chunks were launched: they share them
    assert all(s.prefix_found > 0 for s in (states[4], states[6]))
    if budget < 40:
        # request 1 was admitted with request 0, when the tree was empty; as its prefill began (after
        # request 0's chunks), it took their pages
        assert states[1].prefix_found > 0
    _clear_and_check_empty(sched)


# -- a pool so small that the tree is evicted and requests preempted all the time ------------------


def _pressure_specs(seed: int, n: int = 14) -> list[tuple[list[int], int]]:
    """Prompts of 5 to 40 tokens, 4 to 32 of them from one of the shared bases, and 16 to 40 new tokens."""
    rng = random.Random(seed)
    specs = []
    for _ in range(n):
        base = rng.choice(BASES)
        prompt = base[: rng.randint(4, 32)] + _tokens(rng.randrange(10**6), rng.randint(1, 8))
        specs.append((prompt, rng.randint(16, 40)))
    return specs


@pytest.mark.parametrize(
    ("kind", "overlap", "budget"),
    [
        ("greedy", False, 8),
        ("greedy", True, 64),
        ("seeded", True, 8),
        ("seeded", False, 64),
        ("eos", True, 16),
    ],
)
def test_constant_eviction_and_preemption_equal_naive(engines, kind, overlap, budget):
    """24 pages of 4 tokens for requests of up to 80 tokens arriving every 3 steps: the tree's pages
    are evicted to make room, requests are preempted (their pages go to the tree), and every output is
    the one of the request alone without a prefix cache."""
    big, small = engines(4), engines(4, 24)
    specs = _pressure_specs({"greedy": 1, "seeded": 2, "eos": 3}[kind])
    schedule = [(3 * i, prompt, _params(kind, n, i)) for i, (prompt, n) in enumerate(specs)]
    name = f"prefix-pressure-{kind}-{overlap}-{budget}"
    sched = _scheduler(small, "radix", overlap=overlap, max_prefill_tokens=budget, model_name=name)
    states = _run_schedule(sched, schedule)
    assert sched.prefix_evicted_pages > 0
    assert _metric("minisgl_prefix_cache_evicted_pages_total", name) == sched.prefix_evicted_pages
    assert sched.preemptions > 0
    assert sched.prefix_cached_tokens > 0
    for state, (_, prompt, params) in zip(states, schedule):
        assert (state.output_ids, state.finish_reason) == tuple(_naive_alone(big, prompt, params)), state.uid
    _clear_and_check_empty(sched)


# -- conversations --------------------------------------------------------------------------------


def _conversations(sched: Scheduler, turns: int = 4) -> list:
    """Two conversations taking turns on `sched`, each turn run alone: turn k+1's prompt is turn k's
    prompt, its output and new ids. Returns the states in the order they ran."""
    prompts = [BASES[0][:20], BASES[0][:11] + _tokens(9, 10)]  # they share 11 tokens
    states = []
    for turn in range(turns):
        for conv in range(2):
            [state] = _run_schedule(sched, [(0, prompts[conv], _greedy(5 + turn))])
            states.append(state)
            prompts[conv] = prompts[conv] + state.output_ids + _tokens(10 * turn + conv, 3 + conv)
    return states


@pytest.mark.parametrize(("page_size", "overlap"), [(1, True), (4, False), (16, True)])
def test_multi_turn_conversations(engines, page_size, overlap):
    """Each turn finds the whole pages of everything its conversation computed so far, and the outputs
    are naive's (whose prompts, built from naive's outputs, are then the same)."""
    engine = engines(page_size)
    naive = _conversations(_scheduler(engine, "naive", overlap=overlap))  # before radix: one KV buffer
    sched = _scheduler(engine, "radix", overlap=overlap)
    states = _conversations(sched)
    computed: list[list[int]] = []
    for i, (state, ref) in enumerate(zip(states, naive)):
        assert state.prompt_ids == ref.prompt_ids, i
        assert state.output_ids == ref.output_ids, i
        expected = _expected_hit(state.prompt_ids, computed, page_size)
        assert state.prefix_found == expected, i
        if i >= 2:  # at least the whole pages of the conversation's previous turn
            assert expected >= len(computed[i - 2]) // page_size * page_size > 0
        computed.append(_computed(state))
    assert states[1].prefix_found == 11 // page_size * page_size  # the other conversation's 11 tokens
    assert sched.prefix_evicted_pages == 0
    _clear_and_check_empty(sched)


# -- hit accounting and metrics -------------------------------------------------------------------


@pytest.mark.parametrize("cache_type", ["radix", "naive"])
def test_hit_accounting_and_metrics(engines, cache_type):
    """A second identical request finds (len(prompt) - 1) // page_size * page_size tokens cached (none
    with naive); the lookup counter grows by the prompt's length each time; the Prometheus counters
    follow, prompt tokens count only what was computed, and at rest the requests hold no page while the
    tree holds its own."""
    page_size = 4
    engine = engines(page_size)
    name = f"prefix-accounting-{cache_type}"
    sched = _scheduler(engine, cache_type, overlap=True, model_name=name)
    hit_metric, lookup_metric = (
        "minisgl_prefix_cache_hit_tokens_total",
        "minisgl_prefix_cache_lookup_tokens_total",
    )
    lengths = (1, 3, 4, 5, 8, 9, 13, 40)
    for length in lengths:
        prompt = _tokens(length, length)
        for repeat in range(2):
            before = (sched.prefix_lookup_tokens, sched.prefix_cached_tokens)
            prompt_metric = _metric("minisgl_prompt_tokens_total", name)
            [state] = _run_schedule(sched, [(0, prompt, _greedy(3))])
            expected = (length - 1) // page_size * page_size if cache_type == "radix" and repeat else 0
            assert state.prefix_found == expected
            assert sched.prefix_lookup_tokens == before[0] + length
            assert sched.prefix_cached_tokens == before[1] + expected
            assert _metric("minisgl_prompt_tokens_total", name) - prompt_metric == length - expected
            assert _metric(hit_metric, name) == sched.prefix_cached_tokens
            assert _metric(lookup_metric, name) == sched.prefix_lookup_tokens
            assert _metric("minisgl_kv_cache_usage_ratio", name) == 0.0
            tree_pages = 0 if cache_type == "naive" else sched.prep.cache.num_pages
            assert _metric("minisgl_prefix_cache_pages", name) == tree_pages
            assert sched.prep.pages.num_used == tree_pages
    assert sched.prefix_cached_tokens == (
        0 if cache_type == "naive" else sum((n - 1) // 4 * 4 for n in lengths)
    )
    if cache_type == "radix":
        assert sched.prep.cache.num_pages > 0
        _clear_and_check_empty(sched)
        assert _metric("minisgl_prefix_cache_pages", name) == 0
    else:
        assert sched.prefix_cache is None and sched.clear_prefix_cache() == 0
    assert _metric("minisgl_prefix_cache_evicted_pages_total", name) == 0


# -- seeded sampling ------------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True])
def test_seeded_sampling_equals_naive(engines, overlap):
    """Sampled tokens are a function of the seed and the position: a cached prefix does not change them."""
    engine = engines(4)
    schedule = [
        (
            step,
            prompt,
            SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=50 + i, ignore_eos=True),
        )
        for i, (step, prompt, _) in enumerate(_together_schedule(21))
    ]
    schedule += [(12, list(schedule[0][1]), SamplingParams(max_tokens=10, temperature=1.2, seed=99))]
    naive = _run_schedule(_scheduler(engine, "naive", overlap=overlap, max_prefill_tokens=16), schedule)
    sched = _scheduler(engine, "radix", overlap=overlap, max_prefill_tokens=16)
    states = _run_schedule(sched, schedule)
    assert _outputs(states) == _outputs(naive)
    assert states[-1].prefix_found == (len(schedule[0][1]) - 1) // 4 * 4  # request 0's prompt, cached
    assert sched.prefix_cached_tokens > 0
    _clear_and_check_empty(sched)


# -- aborts -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True])
def test_aborted_mid_prefill_leaves_its_chunks_cached(engines, overlap):
    """A request aborted after two of its prefill chunks hands their whole pages to the tree: the same
    prompt afterwards finds them, and its tokens are naive's."""
    page_size, engine = 4, engines(4)
    prompt = BASES[1][:41]
    reference = _naive_alone(engine, prompt, _greedy(5))  # first: the engine's KV buffer is shared
    sched = _scheduler(engine, "radix", overlap=overlap, max_prefill_tokens=10)
    victim = sched.add_request(prompt, _greedy(5))
    _step(sched)
    _step(sched)
    computed = victim.req.cached_len
    assert 0 < computed < len(prompt) and not victim.output_ids
    sched.abort(victim)
    assert victim.finish_reason == "abort"
    check_clean(sched)
    assert sched.prep.cache.num_pages == computed // page_size > 0
    [again] = _run_schedule(sched, [(0, prompt, _greedy(5))])
    assert again.prefix_found == computed // page_size * page_size
    assert (again.output_ids, again.finish_reason) == tuple(reference)
    _clear_and_check_empty(sched)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_alone_fills_the_pool_after_its_prompt_was_cached(engines, overlap):
    """Alone, any request that passed the checks fits the pool (max_seq_len never exceeds it): also when
    its prompt's whole pages are all in the tree already, so that it recomputes its last page. Here a
    12-page pool (max_seq_len 48), an 8-token prompt run once, then again with max_tokens 40."""
    engine = engines(4, 12)
    assert engine.max_seq_len == 48
    prompt = BASES[2][:8]
    short, full = _greedy(2), _greedy(engine.max_seq_len - len(prompt))
    references = [_naive_alone(engine, prompt, params) for params in (short, full)]
    sched = _scheduler(engine, "radix", overlap=overlap)
    for params, reference in zip((short, full), references):
        [state] = _run_schedule(sched, [(0, prompt, params)])
        assert (state.output_ids, state.finish_reason, state.error) == (*reference, None)
    assert state.prefix_found == 4
    _clear_and_check_empty(sched)


# -- random arrivals, aborts, shared prefixes and pool sizes ---------------------------------------

# (page_size, num_pages): 56, 160, 48 and 128 tokens
POOLS = ((4, 14), (4, 40), (1, 48), (16, 8))

requests = st.lists(
    st.tuples(
        st.integers(0, 1),  # which shared prefix
        st.one_of(st.integers(0, 36), st.sampled_from([4, 8, 16, 32])),  # how much of it
        st.integers(0, 6),  # new tokens after it
        st.integers(1, 40),  # max_tokens
        st.sampled_from(["greedy", "seeded", "eos"]),
        st.integers(0, 4),  # steps after the previous arrival
        st.one_of(st.none(), st.none(), st.integers(0, 12)),  # aborted this many steps after arriving
    ),
    min_size=3,
    max_size=10,
)
clears = st.lists(st.integers(0, 40), max_size=2)  # steps before which the prefix cache is cleared


def test_random_arrivals_aborts_and_shared_prefixes(engines):
    """Random prompts cut from two shared prefixes, random arrival steps, aborts and clears of the
    prefix cache while requests run, over pools of several sizes and page sizes, overlap on and off,
    several prefill budgets (hypothesis, fixed examples): every request that was not aborted gives the
    tokens it gives alone without a prefix cache, an aborted one a prefix of them; at the end no
    reference remains and clearing the tree frees every page. Over all examples the cache hit, evicted,
    was cleared of pages mid-run, and requests were preempted."""
    totals: Counter = Counter()

    @settings(
        FIXED_EXAMPLES,
        max_examples=25,
        # no shrinking: a failure is reported as drawn, in seconds rather than minutes
        phases=[Phase.explicit, Phase.generate],
    )
    @given(
        reqs=requests,
        clears=clears,
        pool=st.sampled_from(POOLS),
        overlap=st.booleans(),
        budget=st.sampled_from([4, 16, 64]),
    )
    def run(reqs, clears, pool, overlap, budget):
        engine = engines(*pool, max_running_req=5)
        big = engines(pool[0])
        schedule, aborts, step = [], [], 0
        for i, (base, shared, new, max_tokens, kind, gap, abort_after) in enumerate(reqs):
            prompt = (BASES[base][:shared] + _tokens(i, new)) or [BASES[base][0]]
            max_tokens = min(max_tokens, engine.max_seq_len - len(prompt))
            step += gap
            schedule.append((step, prompt, _params(kind, max_tokens, i)))
            if abort_after is not None:
                aborts.append((step + abort_after, i))
        references = [_naive_alone(big, prompt, params) for _, prompt, params in schedule]
        sched = _scheduler(engine, "radix", overlap=overlap, max_prefill_tokens=budget)
        freed: list[int] = []
        states = _run_schedule(sched, schedule, aborts, clears, freed)
        totals["cleared"] += sum(freed)
        totals["hits"] += sched.prefix_cached_tokens
        totals["evicted"] += sched.prefix_evicted_pages
        totals["preemptions"] += sched.preemptions
        assert sched.prefix_cached_tokens <= sched.prefix_lookup_tokens
        for state, (expected, reason) in zip(states, references):
            if state.finish_reason == "abort":
                assert state.output_ids == expected[: len(state.output_ids)]
            else:
                assert (state.output_ids, state.finish_reason) == (expected, reason), state.uid
        _clear_and_check_empty(sched)

    run()
    assert totals["hits"] > 0 and totals["evicted"] > 0 and totals["preemptions"] > 0, totals
    assert totals["cleared"] > 0, totals


# -- the LLM API ----------------------------------------------------------------------------------


def test_llm_cache_type_and_flush_cache(tiny_llama):
    """`LLM(cache_type=...)`: radix (the default) gives naive's tokens over shared prefixes and finds
    them in a later call; `flush_cache()` frees the tree's pages (naive: 0)."""
    prompts = [BASES[0][:30] + _tokens(i, 1 + i) for i in range(4)] + [BASES[0][:30]]
    params = _greedy(6)
    outputs, llms = {}, {}
    for cache_type in ("radix", "naive", None):
        kw = {} if cache_type is None else {"cache_type": cache_type}
        llm = LLM(
            str(tiny_llama),
            device="cpu",
            dtype="float32",
            page_size=4,
            num_page_override=400,
            max_prefill_tokens=16,
            **kw,
        )
        llms[cache_type] = llm
        first = [o.token_ids for o in llm.generate(prompts, params)]
        second = [o.token_ids for o in llm.generate(prompts, params)]
        assert first == second
        outputs[cache_type] = first
        llm_clean(llm)
    try:
        assert outputs["radix"] == outputs["naive"] == outputs[None]
        for cache_type in ("radix", None):  # radix by default
            llm = llms[cache_type]
            sched = llm.scheduler
            assert sched.config.cache_type == "radix"
            # the second call found every prompt's whole pages short of its last token
            assert sched.prefix_cached_tokens >= sum((len(p) - 1) // 4 * 4 for p in prompts)
            held = sched.prep.cache.num_pages
            assert held > 0 and sched.prep.pages.num_used == held
            assert llm.flush_cache() == held
            assert sched.prep.pages.num_used == 0 and sched.prep.cache.num_pages == 0
            assert llm.flush_cache() == 0
            llm_clean(llm)
        naive = llms["naive"]
        assert naive.scheduler.prefix_cache is None and naive.scheduler.prefix_cached_tokens == 0
        assert naive.flush_cache() == 0
    finally:
        for llm in llms.values():
            llm.shutdown()
    with pytest.raises(ValueError, match="cache_type"):
        LLM(str(tiny_llama), device="cpu", dtype="float32", cache_type="lru")


# -- lockstep ranks and tensor parallelism ---------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True])
def test_lockstep_ranks_keep_the_same_tree(tiny_llama, engines, overlap):
    """A leader and a follower scheduler (each over its own small pool, radix by default): they match,
    insert and evict alike (the follower checks rank 0's plan, pages in use included, every step), end
    with the same tokens and the same tree, and a clear on rank 0 empties both."""
    from test_lockstep import Pair

    pair_engines = [
        Engine(
            EngineConfig(
                model_path=str(tiny_llama),
                dtype=torch.float32,
                device="cpu",
                page_size=4,
                max_running_req=4,
                num_page_override=24,
            )
        )
        for _ in range(2)
    ]
    big = engines(4)
    pair = Pair(pair_engines, overlap=overlap, max_prefill_tokens=8)
    try:
        assert pair.lead.prep.cache is not None and pair.follow.prep.cache is not None
        specs = _pressure_specs(5, n=8)
        for i, (prompt, n) in enumerate(specs):
            pair.add(prompt, _params("seeded", n, i))
            pair.step()
            pair.step()
        pair.run(max_steps=3000)
        lead, follow = pair.lead, pair.follow
        assert lead.prefix_cached_tokens > 0 and lead.prefix_evicted_pages > 0
        for attr in ("prefix_cached_tokens", "prefix_lookup_tokens", "prefix_evicted_pages", "preemptions"):
            assert getattr(follow, attr) == getattr(lead, attr), attr
        assert sorted(follow.prep.cache.held_pages()) == sorted(lead.prep.cache.held_pages())
        for i, (state, (prompt, n)) in enumerate(zip(pair.states, specs)):
            assert state.output_ids == _naive_alone(big, prompt, _params("seeded", n, i))[0]
        pair.check_same()
        assert lead.prep.cache.num_pages > 0
        assert lead.clear_prefix_cache() > 0
        with pytest.raises(RuntimeError, match="rank 0"):
            follow.clear_prefix_cache()
        pair.step()  # the follower clears with the next step
        assert lead.prep.pages.num_used == follow.prep.pages.num_used == 0
        assert follow.prep.cache.num_pages == 0
        # and goes on in step with rank 0
        state = pair.add(specs[0][0], _params("seeded", specs[0][1], 0))
        pair.run()
        assert state.output_ids == pair.states[0].output_ids
        pair.check_same()
    finally:
        pair.close()
        for engine in pair_engines:
            engine.shutdown()


@pytest.mark.slow
def test_llm_tp2_radix_equals_tp1_naive(tiny_model):
    """LLM(tp=2) with the prefix cache (two processes, gloo) gives the tokens of one rank without it,
    before and after a flush_cache that must reach the other rank (else the ranks' plans diverge)."""
    from test_tp_launch import _addr

    folder = tiny_model("qwen3")
    prompts = [BASES[1][:21] + _tokens(i, 2 + i) for i in range(3)] + [BASES[1][:21]]
    params = [
        _greedy(5),
        _greedy(4),
        SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True),
        _greedy(3),
    ]
    results = {}
    for tp, cache_type in ((1, "naive"), (2, "radix")):
        small = dict(device="cpu", dtype="float32", page_size=4, max_running_req=4, max_prefill_tokens=16)
        llm = LLM(
            str(folder),
            tp=tp,
            cache_type=cache_type,
            distributed_addr=_addr(),
            distributed_timeout=60,
            **small,
        )
        try:
            runs = [[o.token_ids for o in llm.generate(prompts, params)] for _ in range(2)]
            if cache_type == "radix":
                assert llm.scheduler.prefix_cached_tokens > 0
                assert llm.flush_cache() > 0
            runs.append([o.token_ids for o in llm.generate(prompts, params)])
            llm_clean(llm)
            results[tp] = runs
        finally:
            llm.shutdown()
    assert results[2] == results[1]
    assert results[1][0] == results[1][1] == results[1][2]
