"""The engine's pieces around DecodeRunner (unit tier): the drafter kinds' one dispatch, the LevelStack, the
per-level k choice, the PhaseClock, and the rollout package's import graph.

The end-to-end behaviour of these pieces (tokens, χ², compaction, speculation control) is tested where it always
was (test_rollout, test_speculative, test_block_rollout, test_compaction, test_decode_path); here each piece is
checked against what it must do by itself, exactly (integer bookkeeping: no tolerance).
"""
import ast
from pathlib import Path

import torch

from test_rollout_helpers import random_draft, tiny_policy
from test_block_rollout import _block_draft
from specco.rollout.config import GenerateConfig
from specco.rollout.control import LevelK, SpecController
from specco.rollout.drafters import BLOCK, EAGLE3, engine_kind
from specco.rollout.generate import DecodeRunner
from specco.rollout.phases import PhaseClock
from specco.rollout.sampling import SamplingParams
from specco.rollout.shapes import lookahead

ROLLOUT = Path(__file__).resolve().parents[1] / "specco" / "rollout"
GREEDY = SamplingParams(temperature=0.0)


def _imports(path: Path) -> set[str]:
    """The rollout modules `path` imports (relative `from .x import` and `from . import x`), those under
    `if TYPE_CHECKING:` too: a circle of annotations is still a circle to a reader (generate <-> shapes was one)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            out |= {node.module} if node.module else {a.name for a in node.names}
    return out


def test_rollout_modules_import_no_cycle():
    """generate <-> shapes was a circle (REVIEW item 5): the package's modules (its __init__ aside) form a DAG."""
    graph = {p.stem: _imports(p) & {q.stem for q in ROLLOUT.glob("*.py")} for p in ROLLOUT.glob("*.py")
             if p.stem != "__init__"}
    assert "generate" not in graph["shapes"] and "shapes" in graph["generate"]
    seen, done = set(), set()

    def visit(m, path):
        assert m not in seen or m in done, f"import cycle: {' -> '.join(path + [m])}"
        if m in done:
            return
        seen.add(m)
        for n in sorted(graph[m]):
            visit(n, path + [m])
        done.add(m)
    for m in sorted(graph):
        visit(m, [])


def test_no_drafter_class_dispatch_outside_the_kinds():
    """`isinstance(..., BlockDraft)` only in the two drafters modules (REVIEW item 4) and the export package."""
    pkg = ROLLOUT.parent
    hits = [str(p.relative_to(pkg)) for p in pkg.rglob("*.py") if "isinstance(draft, BlockDraft)" in p.read_text()]
    assert sorted(hits) == ["export/dflash.py", "rollout/drafters.py", "train/drafters.py"], hits


def test_engine_kind_and_lookahead():
    policy = tiny_policy(V=16, h=32, layers=3, seed=5)
    eagle, block = random_draft(policy), _block_draft(policy, "dflash", gamma=4)
    assert engine_kind(None) is None and engine_kind(eagle) is EAGLE3 and engine_kind(block) is BLOCK
    cfg = GenerateConfig(num_draft_tokens=2)
    # EAGLE-3 writes n..n+k; a block drafter's propose writes its whole block n..n+W-1 (W = γ + 1 = 5 here)
    assert (lookahead(cfg, None), lookahead(cfg, eagle), lookahead(cfg, block)) == (0, 2, 4)
    for draft in (eagle, block):  # each kind's own buffers land in the state; nothing of the other kind's
        st = DecodeRunner(policy, cfg, draft)
        st.prefill([[1, 2, 3]])
        has = {n for n in ("d_logits0", "d_hidden0") if getattr(st.st, n) is not None}
        assert st.st.d_cache is not None and has == ({"d_logits0", "d_hidden0"} if draft is eagle else set())


def test_level_stack_composes_root_rows_and_unwinds_outputs():
    """Two nested entries: the inner level's root_rows are the root rows its rows hold (composed through the
    middle level), and unwinding writes each level's outputs back to exactly those root rows."""
    policy = tiny_policy()
    runner = DecodeRunner(policy, GenerateConfig(max_new_tokens=8, sampling=GREEDY, compact_below=0.0))
    runner.prefill([[1, 2], [3], [4, 5, 6], [7]], group_size=4)  # 16 rows at the root
    stack, root = runner.stack, runner.stack.root
    live = torch.tensor([0, 3, 5, 6, 9, 14])  # 6 live rows: into an 8-row level, then 3 of them into 4 rows
    root.st.finished.fill_(True)
    root.st.finished[live] = False
    mid = stack.enter(8)
    assert stack.current is mid and stack.depth == 1
    assert torch.equal(mid.root_rows[:6], live) and bool(mid.st.finished[6:].all())
    mid.st.finished[[0, 2, 4]] = True  # root rows 0, 5, 9 finish at the middle level
    inner = stack.enter(4)
    assert torch.equal(inner.root_rows[:3], live[[1, 3, 5]])
    inner.st.out_len.copy_(torch.tensor([101, 102, 103, 104]))  # marks, to be found at the root rows
    stack.unwind()
    assert stack.current is root and stack.depth == 0
    assert root.st.out_len[live[[1, 3, 5]]].tolist() == [101, 102, 103]
    assert set(runner.stack.levels) == {8, 4}  # kept for later calls


def test_level_k_enters_and_rechecks():
    """A plain parent makes the level plain; the re-check runs at multiples of recheck_rounds only, and a change
    of k is recorded. Costs are pinned (CPU timings are noise)."""
    class FakeLevel:  # what LevelK reads: costs, rows, st's counts, k, choice, the tracked round (none here)
        def __init__(self, accepted):
            self.costs, self.rows, self.k, self.choice = {0: 1.0, 1: 1.1, 2: 1.2}, 16, 2, None
            self.tracked, self.tracking = None, False
            self.st = type("S", (), {"n_accepted": torch.zeros(2, dtype=torch.long),
                                     "n_tried": torch.zeros(2, dtype=torch.long)})()
            self.accepted = accepted
    none = LevelK(None)
    lv = FakeLevel(0)
    none.enter(lv, allow_speculation=True)
    assert lv.k == 2 and none.choices == []  # no controller: the level keeps k_max
    none.enter(lv, allow_speculation=False)
    assert lv.k == 0
    ctl = SpecController(2, min_tries=8, recheck_rounds=4)
    kc = LevelK(ctl)
    lv = FakeLevel(0)
    kc.enter(lv, allow_speculation=True)  # optimistic prior: speculation pays
    assert lv.k == 2 and [c.k for c in kc.choices] == [2]
    lv.st.n_tried += 64  # 64 tries at every position, none accepted
    for rounds in (1, 2, 3, 5):  # not a multiple of 4: nothing re-chosen
        kc.recheck(lv, rounds)
    assert lv.k == 2 and len(kc.choices) == 1
    kc.recheck(lv, 4)
    assert lv.k == 0 and [c.k for c in kc.choices] == [2, 0]
    kc.enter(FakeLevel(0), allow_speculation=False)
    assert kc.choices[-1].k == 0


def test_phase_clock_splits_counters_at_each_lap():
    st = DecodeRunner(tiny_policy(), GenerateConfig(max_new_tokens=4, sampling=GREEDY))
    st.prefill([[1, 2]], group_size=8)
    s = st.st
    clock = PhaseClock(s)
    s.n_emitted += 10
    s.n_row_forwards += 5
    clock.tick()
    clock.tick()
    clock.lap(s, 4)
    s.n_emitted += 3
    s.n_row_forwards += 3
    clock.tick()
    phases = clock.stop(s)
    assert [(p.rows, p.rounds, p.emitted, p.row_rounds) for p in phases] == [(8, 2, 10, 5), (4, 1, 3, 3)]
    assert phases[0].tau == 2.0 and all(p.seconds >= 0 for p in phases)


def test_one_shot_engine_frees_its_runners_on_close():
    """`with RolloutEngine(...)`: the kept runner (KV caches, graphs) is gone when the block ends, without waiting
    for Python's cyclic gc: a runner sits in reference cycles (its levels' closures), and at 32K tokens the warm
    start's pool, tau check and evaluation engines each kept tens of GB alive on the H200 until one ran out."""
    import gc
    import weakref
    from specco.rollout.engine import RolloutEngine
    policy = tiny_policy()
    gc.disable()  # only close() may free it here
    try:
        with RolloutEngine(policy, None, GenerateConfig(max_new_tokens=4, sampling=GREEDY)) as eng:
            eng.generate([[1, 5, 6], [1, 7]])
            (runner,) = eng._runners.values()
            ref = weakref.ref(runner)
            del runner
        assert not eng._runners and ref() is None
    finally:
        gc.enable()
