"""Live-row compaction on CUDA: graphed, compacted generations == eager, uncompacted ones.

CI has no GPU, so this is where the compacted states' captured graphs are exercised: for plain and
speculative decoding (random draft; structured draft with ragged acceptance), greedy and sampled,
the tiny test models on CUDA generate (a) with CUDA graphs and aggressive compaction and (b) eagerly
without compaction, from the same generator seed; tokens and lengths must be equal, log-probs within
1e-4 (TF32 matmuls over different batch sizes). Also reports how many compactions happened. Exits
non-zero on a mismatch.

    python bench/compaction_check.py          # on a CUDA machine
    python bench/compaction_check.py --min-rows 1 --spec-control   # levels below 8 rows, k chosen per level
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from specco.rollout.generate import DecodeRunner, GenerateConfig  # noqa: E402
from specco.rollout.sampling import SamplingParams  # noqa: E402
from test_compaction import compaction_case  # noqa: E402


def _gen(policy, draft, prompts, cfg, G, seed):
    r = DecodeRunner(policy, cfg, draft)
    r.prefill(prompts, G, generator=torch.Generator(device="cuda").manual_seed(seed))
    r.run()
    return r.result(), sorted(r.stack.levels)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--min-rows", type=int, default=8, help="rollout.compact_min_rows: the smallest compacted state")
    ap.add_argument("--spec-control", action="store_true", help="speculation control on (k chosen per level)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/compaction_check.py needs CUDA")
    rows, ok = [], True
    for kind in ("plain", "random_draft", "structured_draft"):
        for temp in (0.0, 1.0):
            # with k chosen per level, only coupled sampling keeps the tokens independent of k (rejection sampling
            # draws another, equally distributed, sample when k changes), so the sampled cases use it there
            sampling = SamplingParams(temperature=temp, coupled=args.spec_control)
            policy, draft, prompts, eos, _ = compaction_case(kind, sampling)
            policy = policy.cuda()
            draft = draft.cuda() if draft is not None else None
            cfg = GenerateConfig(max_new_tokens=64, sampling=sampling, num_draft_tokens=3, spec_control=args.spec_control,
                                 pad_token_id=-1, eos_token_id=eos, compact_min_rows=args.min_rows)
            on, sizes = _gen(policy, draft, prompts, dataclasses.replace(cfg, compact_below=0.6, use_graphs=True),
                                4, 7)
            off, _ = _gen(policy, draft, prompts, dataclasses.replace(cfg, compact_below=0.0, use_graphs=False), 4, 7)
            same = torch.equal(on.tokens, off.tokens) and torch.equal(on.lengths, off.lengths)
            lp = float((on.logprobs - off.logprobs).abs().max())
            good = same and lp <= 1e-4 and len(sizes) > 0
            ok &= good
            row = {"kind": kind, "temperature": temp, "tokens_equal": same, "max_logprob_diff": lp,
                   "compacted_sizes": sizes, "tau_on": on.tau, "tau_off": off.tau, "ok": good}
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = Path(os.environ.get("OUT", "bench/results")) / ("compaction_check_cuda.json" if args.min_rows == 8
                                                           else f"compaction_check_cuda_min{args.min_rows}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args),
                               "rows": rows},
                              indent=1))
    print("ALL OK" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
