"""RolloutEngine: the rollout side of an RL step — holds the policy (+ draft) and generates with them.

The trainer owns the authoritative weights; after each optimizer step it calls `refit` to copy them
into the engine's models. Refit is a boundary and fails loudly (STYLE §10): a draft state without a
draft, a missing/unexpected key or a shape mismatch raises. (A public peer ran for days at zero
acceptance because a draft refit that took no weights was only a warning.)

Per-call costs. An RL loop calls `generate` once per step with the same batch shape and config, so
the engine keeps its `DecodeRunner`s — static buffers plus captured CUDA graphs — keyed by
(config, shape bucket) and reuses them: a call costs the host-side prompt copy, one prefill graph
and the decode rounds, not a fresh capture (which costs more than a short rollout itself).
Captured graphs read the parameters' storage, so weights must change *in place*: refit copies into
the existing tensors (`copy_`), which the next replay sees. If parameter tensors are replaced
(`.to(...)`, `load_state_dict(assign=True)`), the storage fingerprint changes and the cache is dropped.

Refit arrives as a stream of bounded buckets (`refit_buckets`; the trainer side is runner/refit.py), so neither
side holds a second whole copy of the model. Between a rollout and the next refit a colocated engine can give its
memory back to the trainer (`release` / `restore`, rollout.offload; weights.ReleasedWeights says how, and why the
graphs are captured afresh afterwards).
"""
from __future__ import annotations

import gc
from collections import OrderedDict
from typing import Iterable, Mapping, Sequence

import torch
from torch import nn

from ..model.draft import Eagle3Draft
from ..model.policy import Policy
from .config import OFFLOAD_MODES
from .control import SpecController
from .config import GenerateConfig
from .generate import DecodeRunner, GenerateOutput, seeded_generator
from .shapes import pad_prompts, runner_shape
from .weights import (InPlaceLoad, RefitError, ReleasedWeights, compare_fingerprints, fingerprint_rows,
                      weights_fingerprint)

__all__ = ["RolloutEngine", "RefitError", "weights_fingerprint", "OFFLOAD_MODES"]


class RolloutEngine:
    """Generates with its policy (+ draft); `refit` loads new weights in place.

    cache_runners: how many DecodeRunners (one per config and shape bucket) to keep, the least
    recently used dropped first; 0 builds a fresh runner, and captures its graphs, every call.
    cache_gib: a bound on the memory of the kept runners' buffers (KV caches of every level, GiB);
    runners other than the one about to run are dropped, least recently used first, until the rest
    fit. 0: no byte bound (the count bounds it). A runner allocates (and its compacted levels grow)
    during a call, so the bound is enforced after each call.
    """

    def __init__(self, policy: Policy, draft: Eagle3Draft | None = None,
                 cfg: GenerateConfig | None = None, cache_runners: int = 8, cache_gib: float = 0.0):
        self.policy, self.draft = policy.eval(), draft
        self.cfg = cfg or GenerateConfig()
        self.cache_runners, self.cache_gib = cache_runners, cache_gib
        self._runners: OrderedDict[tuple, DecodeRunner] = OrderedDict()
        self._storage: tuple | None = None
        self.released: ReleasedWeights | None = None  # rollout.offload: weights freed since the last rollout
        # One acceptance estimate for every runner of the engine: speculation control follows the
        # live acceptance of the run across calls and batch sizes (control.py).
        self.controller = SpecController(self.cfg.num_draft_tokens) if draft is not None else None
        if draft is not None:
            draft.eval()
            self._check_draft_fits(policy, draft)

    @staticmethod
    def _check_draft_fits(policy: Policy, draft: Eagle3Draft):
        """The tap contract between policy and draft (docs/DESIGN.md §2), checked once at the boundary."""
        pc, dc = policy.cfg, draft.cfg
        if dc.hidden_size != pc.hidden_size:
            raise ValueError(f"draft hidden_size {dc.hidden_size} != policy hidden_size {pc.hidden_size}")
        if dc.target_vocab_size != pc.vocab_size:
            raise ValueError(f"draft target_vocab_size {dc.target_vocab_size} != policy vocab "
                             f"{pc.vocab_size}")
        held = {int(i) for i in policy.layers}
        missing = [i for i in dc.aux_layer_ids if i not in held]
        if missing:
            raise ValueError(f"draft aux layers {missing} are not layers of the policy "
                             f"(it holds {sorted(held)})")
        if policy.embed_tokens is None or policy.lm_head is None:
            raise ValueError("speculative rollouts need a whole policy (embedding and head)")
        if getattr(policy, "tp_group", None) is not None and getattr(draft.cfg, "kind", "eagle3") == "dspark":
            raise ValueError("a DSpark draft on a tensor-parallel engine is not supported (its Markov bias reads "
                             "whole-vocabulary rows); use DFlash or EAGLE-3, or rollout tp 1")

    @property
    def device(self) -> torch.device:
        return next(self.policy.parameters()).device

    def _storage_fingerprint(self) -> tuple:
        """Where every parameter and buffer lives: captured graphs are valid while this holds."""
        models = [self.policy] + ([self.draft] if self.draft is not None else [])
        return tuple((t.data_ptr(), t.dtype) for m in models
                     for t in (*m.parameters(), *m.buffers()))

    def _runner(self, cfg: GenerateConfig, ids: torch.Tensor, group_size: int) -> DecodeRunner:
        """The cached runner for this config and shape bucket (built on a miss)."""
        controller = self.controller if (self.controller is not None
                                         and self.controller.k_max == cfg.num_draft_tokens) else None
        if self.cache_runners <= 0:
            return DecodeRunner(self.policy, cfg, self.draft, controller=controller)
        storage = self._storage_fingerprint()
        if storage != self._storage:  # parameters were replaced, not updated in place
            if self._runners:
                self._runners.clear()
                _release_dropped(self.device)
            self._storage = storage
        shape = runner_shape(cfg, self.device, self.draft, ids.shape[0], ids.shape[1], group_size)
        key = (cfg, shape)
        if key not in self._runners:  # a kept runner for longer prompts serves shorter ones (RunnerShape.holds)
            key = next((k for k in reversed(self._runners) if k[0] == cfg and k[1].holds(shape)), key)
        runner = self._runners.get(key)
        if runner is None:
            runner = self._runners[key] = DecodeRunner(self.policy, cfg, self.draft, controller=controller)
            if len(self._runners) > self.cache_runners:
                while len(self._runners) > self.cache_runners:
                    self._runners.popitem(last=False)  # least recently used
                _release_dropped(self.device)  # only when one was dropped: a collection costs ~0.2 s on CPU
        self._runners.move_to_end(key)
        return runner

    def _bound_memory(self):
        """cache_gib: drop the kept runners other than the newest, oldest first, until the rest fit."""
        if self.cache_gib <= 0:
            return
        for old in list(self._runners)[:-1]:
            if self.cached_bytes() <= self.cache_gib * 2**30:
                break
            del self._runners[old]
            _release_dropped(self.device)

    def cached_bytes(self) -> int:
        """Bytes of the kept runners' buffers (what `cache_gib` bounds)."""
        return sum(r.nbytes() for r in self._runners.values())

    @torch.no_grad()
    def generate(self, prompts: Sequence, group_size: int = 1,
                 generator: torch.Generator | None = None,
                 cfg: GenerateConfig | None = None, speculate: bool = True) -> GenerateOutput:
        """`generate.generate` with this engine's models, reusing buffers and graphs across calls.
        `speculate=False`: plain decoding on the same runner (DecodeRunner.prefill_padded), a baseline."""
        if self.released is not None:  # a boundary: decoding with freed or unfilled weights reads garbage
            why = "not restored" if self.released.entries else f"not refit: {sorted(self.released.awaiting)}"
            raise RefitError(f"generate: the engine's weights were released (rollout.offload) and {why}")
        cfg = cfg or self.cfg
        ids, lens = pad_prompts(prompts)
        runner = self._runner(cfg, ids, group_size)
        runner.prefill_padded(ids, lens, group_size, generator or seeded_generator(self.device), speculate)
        runner.run()
        out = runner.result()
        self._bound_memory()
        return out

    def _models(self) -> dict[str, nn.Module]:
        return {"policy": self.policy} | ({"draft": self.draft} if self.draft is not None else {})

    def dtypes(self, name: str) -> dict[str, torch.dtype]:
        """{state-dict key: dtype} of the engine's `name` model ("policy" / "draft"): what refit casts into, so
        the trainer can cast before it gathers (runner/refit.py) and fingerprint what the engine will hold."""
        return {k: v.dtype for k, v in self._models()[name].state_dict().items()}

    def fingerprints(self, name: str) -> dict[str, torch.Tensor]:
        """{key: (3,) row} of the engine's own `name` weights (weights.tensor_fingerprint)."""
        return fingerprint_rows(self._models()[name].state_dict())

    def check_fingerprints(self, policy_rows: Mapping[str, torch.Tensor] | None,
                           draft_rows: Mapping[str, torch.Tensor] | None, step: int | None = None) -> None:
        """Refit guard: raise RefitError unless the engine's weights have exactly these fingerprints (the
        trainer's, taken as its tensors streamed past, cast to the engine's dtypes: runner/refit.py). The failure
        users of every peer report most is a draft — or a policy — whose weights silently stop reaching the engine
        after a sync while the trainer's loss keeps falling."""
        where = f"after the refit of step {step}" if step is not None else "after refit"
        if self.released is not None and self.released.awaiting:
            raise RefitError(f"{where}: the engine's {sorted(self.released.awaiting)} weights were released "
                             "(rollout.offload) and no refit has filled them")
        if draft_rows is not None and self.draft is None:
            raise RefitError(f"{where}: the trainer has a draft but the engine has none")
        for name, rows in (("policy", policy_rows), ("draft", draft_rows)):
            if rows is not None:
                compare_fingerprints(name, self.fingerprints(name), rows, where)

    def check_weights(self, policy_state: Mapping[str, torch.Tensor],
                      draft_state: Mapping[str, torch.Tensor] | None, step: int | None = None) -> None:
        """`check_fingerprints` against whole state dicts (each cast to the engine's dtypes, one tensor at a time)."""
        rows = {}
        for name, state in (("policy", policy_state), ("draft", draft_state)):
            if state is not None:
                rows[name] = fingerprint_rows(state, self.dtypes(name) if name in self._models() else None)
        self.check_fingerprints(rows.get("policy"), rows.get("draft"), step)

    def refit(self, policy_state: Mapping[str, torch.Tensor] | None,
              draft_state: Mapping[str, torch.Tensor] | None = None) -> dict:
        """Load whole state dicts: `refit_buckets` with each as one bucket. policy_state None keeps the policy;
        draft_state None keeps the draft (a frozen draft is legitimate). Returns {'policy': n, 'draft': n}."""
        return self.refit_buckets(None if policy_state is None else [list(policy_state.items())],
                                  None if draft_state is None else [list(draft_state.items())])

    def refit_buckets(self, policy: Iterable[list] | None, draft: Iterable[list] | None = None) -> dict:
        """Load new weights streamed as buckets of (name, whole tensor) pairs (runner/refit.py), each written in
        place (weights.InPlaceLoad: captured graphs stay valid) and emptied; the policy's stream is consumed
        first, then the draft's. None keeps that model. RefitError unless each model got each of its tensors
        exactly once. Returns {'policy': n_tensors, 'draft': n_tensors}."""
        if draft is not None and self.draft is None:
            raise RefitError("refit got a draft state but this engine has no draft: the draft "
                             "weights would be dropped (build the engine with draft=...)")
        if self.released is not None and self.released.entries:
            raise RefitError("refit into released weights: call engine.restore() first (rollout.offload)")
        counts = {"policy": 0, "draft": 0}
        for name, stream in (("policy", policy), ("draft", draft)):
            if stream is None:
                continue
            load = InPlaceLoad(self._models()[name], name)
            for bucket in stream:
                load.write(bucket)
            counts[name] = load.finish()
            if self.released is not None:
                self.released.awaiting.discard(name)
        if self.released is not None and not self.released.awaiting:
            self.released = None
        return counts

    # -- one-shot engines -----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Drop the kept runners (KV caches, captured graphs, their pools) now. An engine used for one call (the
        warm-start pool, the tau check, an evaluation) must give them back before the next one is built: at 32K
        tokens a runner's buffers are tens of GB, and sitting in reference cycles they outlive the engine (on the
        H200 the long-context run's tau check found 61 GB of earlier engines' graph pools and ran out of memory)."""
        if self._runners:
            self._runners.clear()
            _release_dropped(self.device)

    def __enter__(self) -> "RolloutEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- rollout.offload ----------------------------------------------------------------------------------------
    def release(self, weights: bool, refilled: Sequence[str] = ("policy", "draft")) -> int:
        """Give the device memory back between a rollout and the next refit (rollout.offload): the kept runners
        (KV caches, captured graphs and their pools) always; with `weights` every parameter and buffer storage
        too (weights.ReleasedWeights: the models in `refilled` — those the next refit fills whole — are dropped,
        the others kept on the host). `restore()` before the next refit; the next generate captures its graphs
        afresh (the runners are gone; with weights, the storages' addresses change). Returns the bytes freed
        (the runners' buffers and the weights; the graph pools' private memory is freed too, not counted)."""
        if self.released is not None:
            raise RefitError("release: the engine's weights are released already (restore and refit first)")
        freed = self.cached_bytes()
        if self._runners:
            self._runners.clear()
        if weights:
            self.released = ReleasedWeights.release(self._models(), refilled)
            freed += self.released.nbytes
        self._storage = None
        _release_dropped(self.device)
        return freed

    def restore(self) -> None:
        """Allocate the released weights again (released ones copied back from the host); the models that were
        dropped hold garbage until `refit_buckets` fills them, and `generate` refuses to run until it has."""
        if self.released is not None:
            self.released.restore()


def _release_dropped(device) -> None:
    """Free a dropped runner's KV caches and graph pools now. A runner sits in reference cycles (its levels'
    step closures), so without a collection its memory stays allocated until Python's gc happens to run:
    on the H200 a 316M policy's RL run grew to 130 GB in five steps, one 32 GB cache per new shape bucket."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
