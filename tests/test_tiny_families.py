"""The from-scratch policy's architectures (policy.family): llama (the default), qwen3 and qwen3_moe — a
mixture-of-experts policy trained here, from SFT to co-trained RL, and its dense twin (issue 38 item 4's pair).

What can fail: the saved start policy and the RL-trained policy are the HF architecture the family names, and
transformers loads each to specco's logits (fp32 on CPU, 1e-5: the same math up to op fusion); SFT on a MoE policy
adds the router's load-balancing share (equal to CE + coef x L_aux computed here from the router logits, 1e-6 in
fp64 — only summation order differs); the run config's coefficient reaches SFT; refusals name the key."""
import json

import pytest
import torch

from specco.cli import main
from specco.config import ConfigError
from specco.config_load import load_config
from specco.data.tokenizer import build_char_tokenizer
from specco.model.hf_io import load_policy
from specco.model.policy import Policy
from specco.runner.derive import tiny_policy
from specco.runner.prepare import with_run_overrides
from specco.runner.report import read_jsonl
from specco.train.moe_loss import load_balancing_loss
from specco.train.sft import sft_loss
from job_helpers import job_overrides

DEMO = "configs/demo.toml"
MOE = ["policy.family=qwen3_moe", "policy.num_experts=4", "policy.num_experts_per_tok=2",
       "policy.moe_intermediate_size=32", "policy.hidden_size=32", "policy.num_heads=4", "policy.num_kv_heads=2",
       "policy.intermediate_size=64"]


def _hf_logits_equal(path):
    import transformers
    mine = load_policy(path).eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.tensor([build_char_tokenizer().encode("12+3-4=")])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, mine(ids).logits, atol=1e-5, rtol=1e-5)
    return json.loads((path / "config.json").read_text())


@pytest.mark.e2e
def test_a_moe_policy_from_scratch_trains_and_loads_in_transformers(tmp_path):
    out = tmp_path / "run"
    main(["train", DEMO, "--quiet", *job_overrides(out), *MOE, "sft.steps=4", "policy.router_aux_loss_coef=0.02",
          "arms=[cotrained-dflash]"])
    start = _hf_logits_equal(out / "start_policy")
    assert start["model_type"] == "qwen3_moe" and start["num_experts"] == 4 and start["norm_topk_prob"] is True
    assert start["router_aux_loss_coef"] == 0.02  # the run's coefficient, in SFT already
    assert _hf_logits_equal(out / "policy")["architectures"] == ["Qwen3MoeForCausalLM"]
    steps = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in steps] == [1, 2] and all(r["policy/aux_loss"] > 0 for r in steps)


@pytest.mark.e2e
def test_the_dense_twin_is_qwen3(tmp_path):
    out = tmp_path / "run"
    main(["train", DEMO, "--quiet", *job_overrides(out, 1), "policy.family=qwen3", "policy.hidden_size=32",
          "policy.num_heads=4", "policy.num_kv_heads=2", "policy.intermediate_size=64", "sft.steps=2", "arms=[none]"])
    cfg = _hf_logits_equal(out / "policy")
    assert cfg["model_type"] == "qwen3" and "num_experts" not in cfg


TWIN = ["policy.family=qwen3", "policy.hidden_size=32", "policy.num_heads=4", "policy.num_kv_heads=2",
        "policy.intermediate_size=64"]


@pytest.mark.parametrize("moe_cfg,twin_cfg", [((DEMO, MOE), (DEMO, TWIN)),
                                              (("configs/moe.toml", []), ("configs/moe_dense_twin.toml", []))])
def test_dense_twin_has_the_moe_policys_active_parameters(moe_cfg, twin_cfg):
    """A token's active parameters: the MoE's router + top-k experts of moe_intermediate_size per layer equal the
    twin's one SwiGLU of top_k x moe_intermediate_size, but for the router (E x h per layer). Also the committed
    pair of issue 38's H200 run (on the meta device: ~1B parameters)."""
    tok = build_char_tokenizer()
    moe, twin = (tiny_policy(load_config(*c), tok) for c in (moe_cfg, twin_cfg))
    with torch.device("meta"):
        m, t = Policy(moe), Policy(twin)
    assert moe.moe and not twin.moe and twin.model_type == "qwen3"
    E, k, h, L = moe.num_experts, moe.num_experts_per_tok, moe.hidden_size, moe.num_layers
    per_expert = 3 * h * moe.moe_intermediate_size
    total_moe = sum(p.numel() for p in m.parameters())
    active_moe = total_moe - (E - k) * per_expert * L
    assert active_moe == sum(p.numel() for p in t.parameters()) + E * h * L


def test_sft_loss_adds_the_routers_load_balancing_share():
    torch.manual_seed(0)
    cfg = load_config(DEMO, [*MOE, "policy.router_aux_loss_coef=0.1"])
    policy = with_run_overrides(cfg, Policy(tiny_policy(cfg, build_char_tokenizer()))).double()
    pc = policy.cfg
    ids = torch.randint(3, pc.vocab_size, (3, 9))
    mask = torch.zeros(3, 9, dtype=torch.float64)
    mask[:, 3:7] = 1.0
    mask[2, 5:] = 0.0
    got = sft_loss(policy, ids, mask)
    out = policy(ids)
    ce = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, pc.vocab_size), ids[:, 1:].reshape(-1),
                                           reduction="none").view(3, 8)
    want = (ce * mask[:, :-1]).sum() / mask.sum() + 0.1 * load_balancing_loss(out.router_logits, 2, mask)
    torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-6, atol=1e-9)
    assert abs(float((got - (ce * mask[:, :-1]).sum() / mask.sum()).detach())) > 1e-3  # the share is there


@pytest.mark.parametrize("over,msg", [
    (["policy.family=gpt2"], "policy.family='gpt2'"),
    (["policy.num_experts=4"], "policy.num_experts=4 would do nothing"),
    (["policy.family=qwen3_moe", "policy.num_experts=4"], "needs policy.num_experts >= 2"),
    (["policy.source=/some/dir", "policy.family=qwen3"], "shape the from-scratch tiny policy only"),
])
def test_family_refusals(over, msg):
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace("[", r"\[")):
        load_config(DEMO, over)


def test_layouts_refused_for_the_tiny_families(tmp_path):
    from specco.runner.validate import check_policy
    from specco.runner.derive import check_parallel
    with pytest.raises(ConfigError, match="policy.family='llama' is a dense model"):
        check_parallel(load_config(DEMO, ["parallel.ep=2", "parallel.dp_replicate=2", "train.compile=none"]), 2)
    with pytest.raises(ConfigError, match="tensor parallelism of MoE layers is not implemented"):
        check_policy(load_config(DEMO, [*MOE, "parallel.tp=2"]), tmp_path)
    with pytest.raises(ConfigError, match="has no mixture-of-experts layers; remove the key"):
        check_policy(load_config(DEMO, ["policy.router_aux_loss_coef=0.1"]), tmp_path)
