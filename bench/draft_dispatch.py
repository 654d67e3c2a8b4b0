"""How many aten ops one PPO update of a config dispatches, policy alone and with each co-trained draft kind: the host
side of the train step, which bounds it on a GPU when the kernels are small (a draft update of a 76M policy's
drift workload: docs/experiments/drift.md). Counted below autograd (`TorchDispatchMode`: every op that reaches a
kernel, views included), on the CPU: the count follows the code path, not the device.

    python bench/draft_dispatch.py [--config configs/drift.toml] [--strides 1,4] [--completion 100,200] [--out F]

One update = `cotrain_step` on one minibatch of the config's rows (prompts_per_step x group_size / minibatches)
with the config's step (micro-batches, draft_row_stride, loss chunk), the policy's layers eager (train.compile is
a GPU-side choice), at the config's depth but a small width (the count does not depend on it). `--strides`
repeats each draft's count at other draft row strides: a draft update that costs its dispatch, not its rows,
counts the same ops at every stride."""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_results  # noqa: E402
from long_context_probe import train_batch  # noqa: E402
from specco.config_load import load_config  # noqa: E402
from specco.data.source import load_data  # noqa: E402
from specco.data.tokenizer import build_char_tokenizer  # noqa: E402
from specco.model.policy import Policy  # noqa: E402
from specco.runner.derive import step_config  # noqa: E402
from specco.runner.warmstart import new_block_draft, new_draft  # noqa: E402
from specco.train.cotrain import build_optimizer, cotrain_step  # noqa: E402
from specco.train.sft import tiny_policy_config  # noqa: E402


class OpCount(TorchDispatchMode):
    """{op name: calls} of everything dispatched while active."""

    def __init__(self):
        super().__init__()
        self.calls: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def count_update(policy, draft, batch, scfg) -> collections.Counter:
    """The ops of one update (its second call: the first builds what a run builds once)."""
    opt = build_optimizer(policy, draft, 0.0, 0.0)
    cotrain_step(policy, draft, batch, opt, None, scfg)
    with OpCount() as c:
        cotrain_step(policy, draft, batch, opt, None, scfg)
    return c.calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/drift.toml")
    ap.add_argument("--set", nargs="*", default=[], help="config overrides")
    ap.add_argument("--strides", default="1,4", help="draft row strides to count each draft at")
    ap.add_argument("--completion", default="100,200", help="random completion lengths, lo,hi")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cfg = load_config(a.config, ["train.compile=none", *a.set])
    tok = build_char_tokenizer()
    train, _, _ = load_data(cfg.data, tok)
    pc = cfg.policy
    torch.manual_seed(0)
    policy = Policy(tiny_policy_config(tok, a.hidden, pc.num_layers, 4, 2, 2 * a.hidden, pc.max_positions,
                                       pc.rope_theta))
    rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size // cfg.train.minibatches
    lo, hi = (int(x) for x in a.completion.split(","))
    batch = train_batch(cfg, train, rows, (lo, hi), policy.cfg.vocab_size, "cpu")
    drafts = {"eagle3": new_draft(policy, batch.tokens, cfg.draft.draft_vocab_size, cfg.draft.aux_layer_ids),
              # the block drafter's mask token must be one the samples never use: a prompt column's few ids
              "dflash": new_block_draft(policy, batch.tokens[:, :8], "dflash", cfg.rollout.block_k,
                                        cfg.draft.aux_layer_ids, None, cfg.draft.block_layers, cfg.draft.num_anchors)}
    base = count_update(policy, None, batch, step_config(cfg, "cotrained"))
    res = {"config": a.config, "rows": rows, "width": int(batch.tokens.shape[1]), "layers": pc.num_layers,
           "policy_ops": sum(base.values()), "draft_extra_ops": {}, "top_extra": {}}
    print(f"{rows} rows x {batch.tokens.shape[1]} columns, {pc.num_layers} layers: policy alone "
          f"{res['policy_ops']} ops per update")
    for kind, draft in drafts.items():
        for n in (int(x) for x in a.strides.split(",")):
            calls = count_update(policy, draft, batch, step_config(cfg, "cotrained", draft_row_stride=n))
            extra = collections.Counter(calls)
            extra.subtract(base)
            res["draft_extra_ops"][f"{kind}_stride{n}"] = sum(calls.values()) - res["policy_ops"]
            res["top_extra"][f"{kind}_stride{n}"] = dict(extra.most_common(12))
            print(f"  + {kind} at draft_row_stride {n} ({-(-rows // n)} rows): "
                  f"{res['draft_extra_ops'][f'{kind}_stride{n}']} more ops", flush=True)
    write_results(res, "draft_dispatch", torch.device("cpu"), a.out)


if __name__ == "__main__":
    main()
