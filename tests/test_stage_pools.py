"""The staged KV layout's bookkeeping (stage_pools.py) on fresh random operations, against a
plain Python model of who owns which stage slot; and the per-stage views built on it."""

import random

import pytest
import torch

from uniprefill_sglang.kv_validity import SlotStages, stage_views
from uniprefill_sglang.stage_pools import StageLayout, StagePools, default_stage_fractions


def _pools(full_size=200, sizes=(120, 80, 50)):
    layout = StageLayout([3, 6, 9][:len(sizes)], 12, [s / full_size for s in sizes])
    return StagePools(layout, full_size, sizes, [1] * (len(sizes) + 1), "cpu")


class _Model:
    """Which full slots hold a slot in each stage, kept with sets."""

    def __init__(self, sizes):
        self.sizes = list(sizes)
        self.holds = [set() for _ in sizes]  # full slots holding a slot in stage s + 1

    def assign(self, slots):
        if any(len(h) + len(slots) > size for h, size in zip(self.holds, self.sizes)):
            return False
        for h in self.holds:
            h.update(slots)
        return True

    def release(self, slots, first_stage):
        for h in self.holds[first_stage - 1:]:
            h.difference_update(slots)


@pytest.mark.parametrize("seed", range(6))
def test_random_assign_release_keeps_every_stage_slot_owned_once(seed):
    rng = random.Random(seed)
    pools = _pools()
    model = _Model(pools.sizes)
    free_full = list(range(1, pools.full_size + 1))
    used_full = []
    for _ in range(300):
        op = rng.random()
        if op < 0.4 and free_full:
            n = rng.randint(1, 40)
            take = free_full[:n]
            ok = pools.assign(torch.tensor(take))
            assert ok == model.assign(take)
            if ok:
                free_full, used_full = free_full[len(take):], used_full + take
        elif op < 0.75 and used_full:  # a drop: some slots leave the stages after one
            slots = rng.sample(used_full, rng.randint(0, min(30, len(used_full))))
            stage = rng.randint(1, pools.num_stages)
            pools.release(torch.tensor(slots, dtype=torch.int64), stage)
            model.release(slots, stage)
        elif used_full:  # SGLang frees full slots (some released before: idempotent)
            slots = rng.sample(used_full, rng.randint(1, min(30, len(used_full))))
            pools.release(torch.tensor(slots, dtype=torch.int64))
            model.release(slots, 1)
            used_full = [s for s in used_full if s not in set(slots)]
            free_full += slots
        assert pools.check(torch.tensor(free_full, dtype=torch.int64)) == []
        for s, holds in enumerate(model.holds, start=1):
            held = set(torch.nonzero(pools.maps[s - 1] > 0).flatten().tolist())
            assert held == holds
            assert pools.free_counts()[s - 1] == pools.sizes[s - 1] - len(holds)
        assert pools.available() == min(size - len(h) for size, h in zip(pools.sizes,
                                                                           model.holds))


def test_check_reports_a_leaked_and_a_doubly_owned_slot():
    pools = _pools()
    slots = torch.arange(1, 11)
    assert pools.assign(slots)
    pools.maps[0, 3] = 0  # a stage slot nobody owns and nobody can free
    assert any("not exactly one" in p for p in pools.check())
    pools.maps[0, 3] = pools.maps[0, 4]  # and one owned twice
    assert any("not exactly one" in p for p in pools.check())
    pools.clear()
    assert pools.check() == []
    assert pools.assign(slots)
    assert any("held by free full slots" in p for p in pools.check(slots[:2]))


def test_a_full_stage_refuses_without_taking_anything():
    pools = _pools(sizes=(30, 10))
    assert pools.assign(torch.arange(1, 9))
    before = pools.free_counts()
    assert not pools.assign(torch.arange(9, 12))  # stage 2 has 2 left
    assert pools.free_counts() == before
    assert pools.check() == []


@pytest.mark.parametrize("seed", range(8))
def test_admission_never_counts_stage_room_that_eviction_cannot_give(seed):
    """Admission budgets `full free + evictable - shortfall`; evicting every evictable token
    must leave at least that much room in every stage, whatever those tokens held."""
    rng = random.Random(seed)
    pools = _pools(full_size=300, sizes=(200, 120))
    used = list(range(1, rng.randint(20, 120)))
    assert pools.assign(torch.tensor(used))
    for s in (1, 2):  # drops: random tokens leave stage s onwards
        pools.release(torch.tensor(rng.sample(used, rng.randint(0, len(used)))), s)
    evictable = rng.sample(used, rng.randint(0, len(used)))
    full_available = pools.full_size - len(used)
    budget = full_available + len(evictable) - pools.shortfall(
        full_available, len(used), len(evictable))
    pools.release(torch.tensor(evictable, dtype=torch.int64))
    assert min(pools.free_counts()) >= budget


def test_layout_of_the_llama_schedule_is_the_ideal_48_percent():
    layout = StageLayout([7, 11, 15, 19, 23, 27], 32, default_stage_fractions(6, (0.5, 0.8)))
    assert layout.layers_per_stage() == [8, 4, 4, 4, 4, 4, 4]
    ideal = StageLayout([7, 11, 15, 19, 23, 27], 32, [0.5, 0.4, 0.32, 0.256, 0.2048, 0.16384])
    assert ideal.kv_fraction() == pytest.approx(0.48, abs=1e-3)
    assert layout.kv_fraction() == pytest.approx(0.48 + 0.02 * 24 / 32, abs=1e-3)
    assert default_stage_fractions(3, None) == (1.0, 1.0, 1.0)
    # A pool never holds less than one request needs, nor more than the full pool.
    assert StageLayout([7], 32, [0.1], min_slots=5000).stage_sizes(20000) == [5000]
    assert StageLayout([7], 32, [0.1], min_slots=5000).stage_sizes(3000) == [3000]


@pytest.mark.parametrize("seed", range(3))
def test_decode_views_name_each_stages_own_slots(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    pools = _pools(full_size=400, sizes=(300, 200, 150))
    slots = SlotStages(401, 3, "cpu", pools)
    req_to_token = torch.zeros(4, 60, dtype=torch.int32)
    lens = [rng.randint(1, 37) for _ in range(4)]  # fits the smallest stage pool
    full = torch.randperm(400)[: sum(lens)] + 1
    assert pools.assign(full)
    start = 0
    for b, n in enumerate(lens):
        req_to_token[b, :n] = full[start:start + n].to(torch.int32)
        start += n
    for stage in (0, 1, 2):  # random drops among the tokens still alive
        alive = full[slots.slot_stage[full] == slots.full]
        slots.mark_dropped(alive[torch.rand(alive.shape[0]) < 0.25], stage)
    rows = torch.arange(4)
    counts, indptr, indices = stage_views(slots, req_to_token, rows,
                                          torch.tensor(lens), sum(lens), 4)
    for s in (1, 2, 3):
        for b, n in enumerate(lens):
            seq = req_to_token[b, :n].long()
            want = [int(pools.maps[s - 1][x]) for x in seq.tolist()
                    if int(slots.slot_stage[x]) >= s]
            got = indices[s - 1][indptr[s - 1][b]:indptr[s - 1][b + 1]].tolist()
            assert got == want and all(w > 0 for w in want)
    assert pools.check() == []


def test_idle_pool_problems_counts_every_stage_pool():
    """The leak check of the soak and the HTTP end-state test reads every stage pool, the
    pools' own invariant check and the private prefix slots, not the full pool alone."""
    from uniprefill_sglang.tools.server_process import idle_pool_problems, leaked_slots

    sound = dict(idle=True, protected_kv_tokens=0, available_kv_tokens=900,
                 evictable_kv_tokens=100, max_total_num_tokens=1000, free_req_slots=4,
                 req_slots=4, parked_requests=0, private_prefix_slots=0, kv_pool_problems=[],
                 kv_pools=[dict(stage=0, size=1000, free=900), dict(stage=1, size=500, free=440)])
    assert idle_pool_problems(sound) == [] and leaked_slots(sound) == 0
    leaking = dict(sound, kv_pools=[sound["kv_pools"][0], dict(stage=1, size=500, free=380)],
                   kv_pool_problems=["stage 1: 20 slots neither free nor mapped"],
                   private_prefix_slots=7)
    problems = idle_pool_problems(leaking)
    assert any("stage pool 1 holds 20 slots" in p for p in problems), problems
    assert any(p.startswith("kv_pool_problems:") for p in problems), problems
    assert any("private_prefix_slots=7" in p for p in problems), problems
    assert leaked_slots(leaking) == 20
