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
"""
from __future__ import annotations

import gc
from collections import OrderedDict
from typing import Mapping, Sequence

import torch
from torch import nn

from ..model.draft import Eagle3Draft
from ..model.policy import Policy
from .control import SpecController
from .generate import DecodeRunner, GenerateConfig, GenerateOutput, seeded_generator
from .shapes import pad_prompts, runner_shape


class RefitError(RuntimeError):
    """New weights could not be loaded into the rollout engine exactly."""


def _load_exact(model: nn.Module, state: Mapping[str, torch.Tensor], what: str) -> int:
    """Copy `state` into `model` in place; every key must exist on both sides with equal shapes."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise RefitError(f"{what} refit: state keys do not match the engine's model; "
                         f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                         f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")
    bad = [(k, tuple(v.shape), tuple(own[k].shape)) for k, v in state.items()
           if tuple(v.shape) != tuple(own[k].shape)]
    if bad:
        raise RefitError(f"{what} refit: shape mismatch (key, given, expected): {bad[:8]}")
    with torch.no_grad():
        for k, v in state.items():  # in-place copy keeps tied weights tied and graph buffers valid
            own[k].copy_(v)
    return len(state)


def weights_fingerprint(state: Mapping[str, torch.Tensor],
                        dtypes: Mapping[str, torch.dtype] | None = None) -> torch.Tensor:
    """A cheap checksum of a state dict: per tensor (sorted by key) its sum, its L2 norm (both reduced
    in fp64) and the dot product of neighbouring elements Σ x_i x_{i+1} (so moved elements show too) —
    one pass over the weights, no copy of an fp32/fp64 tensor (bf16/fp16 ones are upcast to fp32, exactly, one
    at a time). Two identical state dicts on one device give
    bitwise-identical fingerprints (the same reductions over the same values and layouts); it is a
    guard against stale weights, not a cryptographic hash. dtypes: cast each tensor to this dtype first
    (one tensor at a time) — the trainer's fp32 weights as a bf16 engine holds them after refit's cast."""
    rows = []
    for key in sorted(state):
        flat = state[key].detach().reshape(-1)
        if dtypes is not None:
            flat = flat.to(dtypes[key])  # round to nearest even, as refit's copy_ does
        if flat.dtype in (torch.bfloat16, torch.float16):
            flat = flat.float()  # exact; the neighbour products in bf16 would round away small changes
        if not flat.is_floating_point():  # small integer / bool buffers (vocabulary maps)
            flat = flat.double()
        neighbours = torch.dot(flat[:-1], flat[1:]).double() if flat.numel() > 1 else flat.sum().double()
        rows.append(torch.stack([flat.sum(dtype=torch.float64), torch.linalg.vector_norm(flat, dtype=torch.float64),
                                 neighbours]))
    return torch.stack(rows).cpu()  # (n_tensors, 3)


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
        cfg = cfg or self.cfg
        ids, lens = pad_prompts(prompts)
        runner = self._runner(cfg, ids, group_size)
        runner.prefill_padded(ids, lens, group_size, generator or seeded_generator(self.device), speculate)
        runner.run()
        out = runner.result()
        self._bound_memory()
        return out

    def check_weights(self, policy_state: Mapping[str, torch.Tensor],
                      draft_state: Mapping[str, torch.Tensor] | None, step: int | None = None) -> None:
        """Refit guard: raise RefitError unless the engine holds exactly these weights (fingerprints
        equal). The failure users of every peer report most is a draft — or a policy — whose weights
        silently stop reaching the engine after a sync while the trainer's loss keeps falling."""
        where = f"after the refit of step {step}" if step is not None else "after refit"
        checks = [("policy", self.policy, policy_state)]
        if draft_state is not None:
            if self.draft is None:
                raise RefitError(f"{where}: the trainer has a draft but the engine has none")
            checks.append(("draft", self.draft, draft_state))
        for name, model, state in checks:
            own = model.state_dict()
            if set(own) != set(state):
                raise RefitError(f"{where}: the engine's {name} has other tensors than the trainer's "
                                 f"(missing {sorted(set(state) - set(own))[:5]}, extra {sorted(set(own) - set(state))[:5]})")
            # an engine in another dtype (rollout.dtype) holds the trainer's weights as refit cast them
            mine, theirs = weights_fingerprint(own), weights_fingerprint(state, {k: v.dtype for k, v in own.items()})
            if not torch.equal(mine, theirs):
                bad = [k for k, a, b in zip(sorted(state), mine, theirs) if not torch.equal(a, b)]
                raise RefitError(f"{where}: the engine's {name} weights differ from the trainer's in "
                                 f"{len(bad)} tensor(s), e.g. {bad[:5]} (fingerprints compared: sum, norm, "
                                 "neighbour products per tensor) — the new weights did not reach the rollout engine")

    def refit(self, policy_state: Mapping[str, torch.Tensor] | None,
              draft_state: Mapping[str, torch.Tensor] | None = None) -> dict:
        """Load new weights. policy_state None keeps the policy; draft_state None keeps the draft
        (a frozen draft is legitimate). Returns {'policy': n_tensors, 'draft': n_tensors}."""
        if draft_state is not None and self.draft is None:
            raise RefitError("refit got a draft state but this engine has no draft: the draft "
                             "weights would be dropped (build the engine with draft=...)")
        n_policy = _load_exact(self.policy, policy_state, "policy") if policy_state is not None else 0
        n_draft = _load_exact(self.draft, draft_state, "draft") if draft_state is not None else 0
        return {"policy": n_policy, "draft": n_draft}


def _release_dropped(device) -> None:
    """Free a dropped runner's KV caches and graph pools now. A runner sits in reference cycles (its levels'
    step closures), so without a collection its memory stays allocated until Python's gc happens to run:
    on the H200 a 316M policy's RL run grew to 130 GB in five steps, one 32 GB cache per new shape bucket."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
