"""Which rows hold a speculative rollout back: per-row acceptance of each warm draft of a finished run.

A batched rollout decodes until its slowest row stops, so the step's target forwards are set by that row's
own tokens per round, not by the mean τ (BENCHMARKS.md, the long run: DFlash's slowest rows got <= 1.5-1.8
tokens per round against a mean of 4.5-5.8). This bench takes a run's out_dir (its SFT policy and warm
drafts), generates the same held-out prompts with each drafter at the run's temperature and a fixed k (no
speculation control), and reports per row: length, decode rounds (the engine's `row_rounds`), τ, and the
entropy of the policy's next-token distribution over the completion (teacher-forced, one forward per row),
its mean and its mean over the last 256 tokens — to see whether the slow rows are the long ones, the
high-entropy ones, or both. Per drafter: τ overall, τ by entropy and by length quartile, the Pearson
correlation of per-row τ with entropy, and the slowest rows' text (head and tail). Quartiles and
correlations are over rows of >= --min-len tokens: the 3-5-token direct answers are high-entropy and low-τ
for want of tokens, and dominated the first run's quartiles. By default the batch is an RL step's
(rollout.prompts_per_step x rollout.group_size): a runaway row is rare, 1 in ~256 rows on configs/long.toml,
and 64 single samples showed none.

    python bench/tail_rows.py configs/long.toml              # after `specco train configs/long.toml`
    python bench/tail_rows.py configs/demo.toml draft.kind=dspark --out-dir /tmp/dsp --prompts 32
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_results  # noqa: E402
from specco.config_load import load_config  # noqa: E402
from specco.data.source import load_data  # noqa: E402
from specco.data.tokenizer import load_tokenizer  # noqa: E402
from specco.model.hf_io import load_policy  # noqa: E402
from specco.rollout.engine import RolloutEngine  # noqa: E402
from specco.runner.derive import arm_config, generate_config, warm_configs  # noqa: E402
from specco.runner.warmstart import load_draft_dir  # noqa: E402


def quartile_means(key: torch.Tensor, val: torch.Tensor) -> list[float]:
    """Mean of `val` over the rows in each quartile of `key` (lowest first)."""
    order = key.argsort()
    return [float(val[q].mean()) for q in order.tensor_split(4) if q.numel()]


@torch.no_grad()
def completion_entropy(policy, prompt: list[int], completion: torch.Tensor, temperature: float,
                       tail: int = 256) -> tuple[float, float]:
    """Entropy (nats) of softmax(logits / T) at the positions that predicted the completion's tokens: its mean
    over the completion and over the last `tail` of them (where a runaway row has run away)."""
    ids = torch.cat([torch.tensor(prompt, device=completion.device), completion])[None]
    logits = policy(ids).logits[0, len(prompt) - 1: ids.shape[1] - 1].float() / max(temperature, 1e-6)
    logp = logits.log_softmax(-1)
    ent = -(logp.exp() * logp).sum(-1)  # (completion length,)
    return float(ent.mean()), float(ent[-tail:].mean())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", help="the run's config (the one `specco train` ran)")
    ap.add_argument("overrides", nargs="*", help="the run's command-line overrides (key=value)")
    ap.add_argument("--out-dir", default=None, help="the run's out_dir (default: the config's)")
    ap.add_argument("--prompts", type=int, default=None, help="default rollout.prompts_per_step")
    ap.add_argument("--group-size", type=int, default=None, help="samples per prompt; default rollout.group_size")
    ap.add_argument("--min-len", type=int, default=64, help="rows shorter than this leave the quartiles and correlations")
    ap.add_argument("--seed", type=int, default=777, help="held-out prompts: not the RL stream's seed")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--show", type=int, default=3, help="slowest rows printed per drafter")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cfg = load_config(a.config, a.overrides)
    out_dir = Path(a.out_dir or cfg.out_dir)
    dev = torch.device(a.device)
    if dev.type == "cuda":
        torch.set_float32_matmul_precision("high")
    policy = load_policy(out_dir / "start_policy", device=dev).eval()
    tok = load_tokenizer(out_dir / "start_policy")
    source = load_data(cfg.data, tok)[0]
    G = a.group_size or cfg.rollout.group_size
    prompts = [e.prompt_ids for e in source.examples(a.prompts or cfg.rollout.prompts_per_step, seed=a.seed)]
    T = cfg.rollout.temperature
    results = {}
    for kind in warm_configs(cfg):
        path = out_dir / ("warm_draft" if kind == cfg.draft.kind else f"warm_draft_{kind}")
        if not path.exists():
            print(f"{kind}: no {path}, skipped", flush=True)
            continue
        draft = load_draft_dir(path, device=dev).eval()
        arm_cfg, _ = arm_config(cfg, f"frozen-{kind}")
        gen = dataclasses.replace(generate_config(arm_cfg, tok.stop_ids, tok.pad_id), spec_control=False)
        t0 = time.perf_counter()
        out = RolloutEngine(policy, draft, gen).generate(prompts, G, generator=torch.Generator(device=dev).manual_seed(0))
        seconds = time.perf_counter() - t0
        lengths, rounds = out.lengths.cpu(), out.row_rounds.cpu()
        tau = (lengths - 1).float() / rounds.clamp_min(1).float()
        N = lengths.numel()  # prompts x G rows, row b*G + g
        ent, tail_ent = torch.tensor([completion_entropy(policy, prompts[i // G], out.tokens[i, :int(lengths[i])], T)
                                      for i in range(N)]).unbind(1)
        live = (rounds > 0) & (lengths >= a.min_len)
        corr = float(torch.corrcoef(torch.stack([tau[live], ent[live]]))[0, 1]) if int(live.sum()) > 2 else float("nan")
        slow = rounds.argsort(descending=True)[: a.show].tolist()
        texts = [tok.decode(out.tokens[i, :int(lengths[i])]) for i in slow]
        results[kind] = {
            "k": gen.num_draft_tokens, "tau": out.tau, "seconds": seconds, "target_forwards": out.num_target_forwards,
            "phases": [list(p) for p in out.phases], "tau_by_entropy_quartile": quartile_means(ent[live], tau[live]),
            "tau_by_tail_entropy_quartile": quartile_means(tail_ent[live], tau[live]),
            "tau_by_length_quartile": quartile_means(lengths[live].float(), tau[live]), "corr_tau_entropy": corr,
            "rows_in_quartiles": int(live.sum()), "rows_at_max": int((lengths >= gen.max_new_tokens).sum()),
            "rows": [{"length": int(lengths[i]), "rounds": int(rounds[i]), "tau": float(tau[i]),
                      "entropy": float(ent[i]), "tail_entropy": float(tail_ent[i])} for i in range(N)],
            "slowest": [{"row": i, "length": int(lengths[i]), "rounds": int(rounds[i]), "tau": float(tau[i]),
                         "entropy": float(ent[i]), "tail_entropy": float(tail_ent[i]),
                         "text": t if len(t) <= 400 else f"{t[:200]} … {t[-200:]}"}
                        for i, t in zip(slow, texts)]}
        r = results[kind]
        print(f"{kind} (k={r['k']}): tau {r['tau']:.2f}, {r['target_forwards']} target forwards, {seconds:.2f} s, "
              f"{r['rows_at_max']} of {N} rows at the budget; over {r['rows_in_quartiles']} rows of >= {a.min_len} "
              f"tokens: tau by entropy quartile {[round(x, 2) for x in r['tau_by_entropy_quartile']]}, by tail-entropy "
              f"quartile {[round(x, 2) for x in r['tau_by_tail_entropy_quartile']]}, by length quartile "
              f"{[round(x, 2) for x in r['tau_by_length_quartile']]}, corr(tau, entropy) {corr:.2f}", flush=True)
        for s in r["slowest"]:
            print(f"   slow row {s['row']}: {s['length']} tokens in {s['rounds']} rounds (tau {s['tau']:.2f}), "
                  f"entropy {s['entropy']:.2f} (last 256: {s['tail_entropy']:.2f}): {s['text'][-160:]!r}", flush=True)
    write_results({"temperature": T, "results": results}, "tail_rows", dev, a.out)


if __name__ == "__main__":
    main()
