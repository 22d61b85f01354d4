"""Content tags and the cache of dropped models (``membackend._residency.content``, issue 41, item 2), on the host
backend and simulated GPUs: a tag lives exactly as long as the bytes under it, a cached model goes before any
page of a live model, a range borrowed from the cache moves to its reader (the pages only it held are freed),
and the cache is bounded by its limit and the budget."""

from __future__ import annotations

import pytest
from test_residency import Env, load, loaded

from membackend._residency import ResidencyManager
from membackend._residency.content import Tags

TARGETS = ["host", "h200", "rocm-win-2gpu", "strix-halo-128gb"]


@pytest.fixture(params=TARGETS)
def env(request):
    return Env(request.param)


def test_tags_never_overlap_and_a_key_names_one_range():
    t = Tags()
    t.add(0, 100, "a")
    t.add(100, 200, "b")
    t.add(50, 150, "c")  # overlaps both: they go
    assert t.entries == [(50, 150, "c")] and set(t.by_key) == {"c"}
    t.add(300, 400, "c")  # the same key elsewhere: its earlier range goes
    assert t.entries == [(300, 400, "c")]
    t.add(0, 10, "d")
    assert t.covered(5, 6) and not t.covered(10, 300) and t.covered(399, 1000)
    assert t.drop(0, 1000) == 2 and not t.entries and not t.by_key
    assert list(Tags().pages(4, 3)) == [0, 0, 0]
    t.add(5, 9, "e")
    assert list(t.pages(4, 3)) == [0, 1, 1]


def test_a_tag_goes_with_the_backing_of_its_pages(env):
    s = env.session()
    policy = ResidencyManager(s)
    a = policy.register("a", env.size(0.3), env.device)
    policy.use([a])
    assert not policy.tag(a, 0, env.page, env.device, "k"), "nothing resident: nothing tagged"
    load(policy, a)
    assert policy.tag(a, 0, env.page, env.device, "k")
    lent = policy.borrow(env.device, "k")
    assert lent is not None and lent.size == env.page
    policy.returned(lent)
    assert policy.shed(a, a.size, env.device) > 0  # its pages go: what was known of them goes too
    policy.use([a])
    load(policy, a)
    assert policy.borrow(env.device, "k") is None
    assert policy.tag(a, 0, env.page, env.device, "k")
    policy.untag(a, env.page // 2, 1, env.device)  # something else is written into it
    assert policy.borrow(env.device, "k") is None


def test_a_borrowed_range_is_pinned_viewed_and_never_its_readers_own(env):
    s, policy, a = loaded(env, 0.3)
    policy.tag(a, 0, env.page, env.device, "k")
    assert policy.borrow(env.device, "k", avoid=(a, 0, env.page)) is None, "a read is never served by itself"
    lent = policy.borrow(env.device, "k")
    assert policy.pinned_and_evictable(a, env.device)[0] == env.page
    before = policy.stats()["a"]["resident"]
    assert policy.shed(a, a.size, env.device) == before - env.page, "the borrowed page is pinned: kept"
    policy.returned(lent)
    assert policy.pinned_and_evictable(a, env.device)[0] == 0


def _cached_model(env, policy, name="a", fraction=0.3, tagged_pages=None):
    """A model loaded, its first ``tagged_pages`` pages tagged (all by default), then dropped into the cache."""
    a = policy.register(name, env.size(fraction), env.device)
    policy.use([a])
    load(policy, a)
    pages = a.size // env.page if tagged_pages is None else tagged_pages
    for p in range(pages):
        assert policy.tag(a, p * env.page, env.page, env.device, (name, p))
    return a, policy.cache(a)


def test_a_dropped_model_keeps_only_its_tagged_pages_as_cache(env):
    s = env.session()
    policy = ResidencyManager(s)
    a, kept = _cached_model(env, policy, tagged_pages=2)
    assert kept == 2 * env.page == policy.cached(env.device)
    assert policy.stats()["a"]["cached"] and policy.evictable(env.device) == kept
    b = policy.register("b", env.size(0.2), env.device)
    policy.use([b])
    load(policy, b)
    assert policy.cache(b) == 0 and not policy.stats()["b"]["cached"], "nothing tagged: nothing to keep"


def test_a_range_read_from_the_cache_moves_and_an_emptied_cached_model_goes(env):
    s = env.session()
    policy = ResidencyManager(s)
    a, kept = _cached_model(env, policy, tagged_pages=2)
    r = a.reservation(env.device)
    lent = policy.borrow(env.device, ("a", 0))
    assert lent.reservation is r and lent.address == r.base
    assert policy.returned(lent, moved=True) == env.page and policy.cached(env.device) == env.page
    policy.returned(policy.borrow(env.device, ("a", 1)), moved=True)
    assert a not in policy.models() and r.released, "every byte moved: the cached model and its range went"


def test_the_cache_goes_before_any_page_of_a_live_model(env):
    s = env.session()
    policy = ResidencyManager(s)
    live = policy.register("live", env.size(0.35), env.device)
    policy.use([live])
    load(policy, live)
    other = policy.register("other", env.size(0.35), env.device)
    policy.use([other])
    load(policy, other)
    dropped, kept = _cached_model(env, policy, "dropped", 0.2)
    assert kept
    new = policy.register("new", env.size(0.25), env.device)  # fits only where 0.2 of the pool goes
    policy.use([new])  # live and other are idle, least recently used first: yet the cache goes first
    assert load(policy, new).ok
    stats = policy.stats()
    assert stats["live"]["resident"] == live.size and stats["other"]["resident"] == other.size
    assert policy.cached(env.device) == 0 and dropped not in policy.models()


def test_the_cache_is_bounded_by_its_limit_and_the_budget_and_free_empties_it(env):
    s = env.session()
    policy = ResidencyManager(s)
    policy.cache_limit = 0
    a, kept = _cached_model(env, policy, "a", 0.2)
    assert kept == 0 and not policy.stats()["a"]["cached"], "off: nothing is cached"
    policy.unregister(a)
    policy.cache_limit = 3 * env.page
    _cached_model(env, policy, "b", 0.2)
    assert policy.cached(env.device) <= 3 * env.page
    policy.cache_limit = None
    policy.drop_cache()
    _cached_model(env, policy, "c", 0.2)
    assert policy.cached(env.device) > 0
    s.set_headroom(env.device, s.budget_query(env.device).total - env.page)  # a cap below the cache
    policy.keep_warm(env.device)
    assert policy.cached(env.device) == 0, "the cache stays within the budget"
    s.set_headroom(env.device, None)
    _cached_model(env, policy, "d", 0.2)
    policy.unload_all()
    assert policy.cached(env.device) == 0 and not [m for m in policy.models() if m.cached]
