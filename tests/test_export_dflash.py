"""DFlash export for vLLM / SGLang and import of that layout (specco/export/dflash.py, specco/export/FORMATS.md "DFlash").

The written config and tensor names are checked against the readers as specco/export/FORMATS.md writes them down
(vLLM's stacking and `model.` prefix, SGLang's module names); export -> import is bit-identical and
generates the same tokens; DSpark and everything that would compute differently are refused by name.
"""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specco.cli import main
from cli_helpers import generate_texts
from specco.export import export_dflash, import_dflash, load_block_draft
from specco.export.dflash import tensor_shapes
from specco.model.config import ConfigError, PolicyConfig
from specco.model.dflash import BlockDraft, BlockDraftConfig
from specco.model.policy import Policy
from specco.rollout.generate import GenerateConfig, generate
from specco.rollout.sampling import SamplingParams
from cli_helpers import DEMO  # noqa: E402

POLICY = PolicyConfig(vocab_size=100, hidden_size=32, intermediate_size=48, num_layers=6, num_heads=4,
                      num_kv_heads=2, max_position_embeddings=256, rope_theta=5e5)


def _draft(kind="dflash", layers=2, seed=0):
    torch.manual_seed(seed)
    d = BlockDraft(BlockDraftConfig.for_policy(POLICY, kind, gamma=4, mask_id=99, num_layers=layers,
                                               aux_layer_ids=(1, 3, 4)))
    with torch.no_grad():
        for n, p in d.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)  # not ones: a swapped or dropped norm would show
    return d.eval()


# The readers' module names (specco/export/FORMATS.md): vLLM stacks q/k/v and gate/up and prefixes `model.`; SGLang's
# DFlashDraftModel has the same modules without the prefix (its loader stacks alike).
def _reader_param(name: str, prefix: str) -> str:
    for a, b in ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
                 (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj")):
        name = name.replace(a, b)
    return prefix + name


def _reader_params(layers: int, prefix: str) -> set:
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.qkv_proj.weight",
                 "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                 "mlp.gate_up_proj.weight", "mlp.down_proj.weight"]
    names = {f"{prefix}{n}" for n in ("fc.weight", "hidden_norm.weight", "norm.weight")}
    return names | {f"{prefix}layers.{i}.{n}" for i in range(layers) for n in per_layer}


def test_layout_is_what_vllm_and_sglang_read(tmp_path):
    draft = _draft()
    out = export_dflash(draft, tmp_path / "x", POLICY)
    cfg, sd = json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 5  # gamma 4 + the anchor slot
    assert cfg["dflash_config"] == {"target_layer_ids": [1, 3, 4], "mask_token_id": 99}
    assert cfg["num_target_layers"] == 6 and cfg["num_hidden_layers"] == 2 and cfg["vocab_size"] == 100
    assert cfg["layer_types"] == ["full_attention"] * 2 and "causal" not in cfg["dflash_config"]
    assert (cfg["attention_bias"], cfg["hidden_act"], cfg["rope_theta"], cfg["head_dim"]) == (False, "silu", 5e5, 8)
    assert "lm_head.weight" not in sd and "embed_tokens.weight" not in sd  # the target's are used
    for prefix in ("model.", ""):  # vLLM, SGLang
        assert {_reader_param(k, prefix) for k in sd} == _reader_params(2, prefix)
    assert {k: tuple(v.shape) for k, v in sd.items()} == tensor_shapes(draft.cfg)


@pytest.mark.e2e
def test_round_trip_is_exact_and_generates_the_same_tokens(tmp_path):
    """export -> import: bit-identical weights and the same config; greedy and sampled speculative generation
    with the imported draft emits what the original does (same uniforms)."""
    draft = _draft()
    back = import_dflash(export_dflash(draft, tmp_path / "x", POLICY), POLICY)
    for k, v in draft.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    same = ("gamma", "mask_id", "aux_layer_ids", "num_layers", "rope_theta", "rms_norm_eps", "head_dim", "kind")
    assert all(getattr(back.cfg, f) == getattr(draft.cfg, f) for f in same)
    torch.manual_seed(1)
    policy = Policy(POLICY).eval()
    prompts = [torch.tensor([3, 1, 4, 1, 5]), torch.tensor([9, 2, 6])]
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)):
        cfg = GenerateConfig(max_new_tokens=12, sampling=params, num_draft_tokens=4)
        a, b = (generate(policy, prompts, cfg, d, 2, generator=torch.Generator().manual_seed(0)) for d in (draft, back))
        assert torch.equal(a.tokens, b.tokens) and a.tau == b.tau
    assert torch.equal(load_block_draft(tmp_path / "x").state_dict()["fc.weight"], draft.state_dict()["fc.weight"])


def test_export_refusals_dtype_and_overwrite(tmp_path):
    with pytest.raises(ConfigError, match="dspark drafter cannot be exported.*DFlash"):
        export_dflash(_draft("dspark"), tmp_path / "s", POLICY)
    deeper = PolicyConfig(**{**POLICY.__dict__, "hidden_size": 64, "intermediate_size": 96})
    with pytest.raises(ConfigError, match="hidden_size 32 != policy hidden_size 64"):
        export_dflash(_draft(), tmp_path / "h", deeper)
    other_rope = PolicyConfig(**{**POLICY.__dict__, "rope_theta": 1e4})
    with pytest.raises(ConfigError, match="RoPE"):
        export_dflash(_draft(), tmp_path / "r", other_rope)
    out = export_dflash(_draft(), tmp_path / "x", POLICY, dtype="bfloat16")
    cfg, sd = json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))
    assert cfg["torch_dtype"] == "bfloat16" and {v.dtype for v in sd.values()} == {torch.bfloat16}
    with pytest.raises(FileExistsError, match="exists"):
        export_dflash(_draft(), out, POLICY)
    export_dflash(_draft(seed=5), out, POLICY, overwrite=True)
    assert load_file(str(out / "model.safetensors"))["fc.weight"].dtype == torch.float32
    assert [p.name for p in tmp_path.iterdir()] == ["x"]  # no temporary or moved-aside directory left


@pytest.mark.parametrize("edit,needle", [
    (lambda c: c["dflash_config"].update(causal=True), "dflash_config.causal"),
    (lambda c: c.update(layer_types=["sliding_attention", "full_attention"]), "layer_types"),
    (lambda c: c.update(attention_bias=True), "attention_bias"),
    (lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling"),
    (lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id"),
    (lambda c: c.update(architectures=["LlamaForCausalLMEagle3"]), "architectures"),
    (lambda c: c.update(num_target_layers=36), "num_target_layers"),
])
def test_import_refusals(tmp_path, edit, needle):
    out = export_dflash(_draft(), tmp_path / "x", POLICY)
    cfg = json.loads((out / "config.json").read_text())
    edit(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=needle):
        import_dflash(out, POLICY)


def test_import_tensor_and_mask_refusals(tmp_path):
    out = export_dflash(_draft(), tmp_path / "x", POLICY)
    sd = load_file(str(out / "model.safetensors"))
    save_file({**sd, "lm_head.weight": torch.zeros(100, 32)}, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match=r"unexpected tensors \['lm_head.weight'\]"):
        import_dflash(out)
    save_file(sd, str(out / "model.safetensors"))
    torch.save(torch.zeros(32), out / "mask_embedding.pt")
    with pytest.raises(ConfigError, match="mask_embedding.pt"):
        import_dflash(out)


@pytest.mark.e2e
def test_cli_export_generate_and_draft_init(tmp_path, capsys):
    """`specco export` of a specco block-draft dir needs --policy and writes the DFlash layout; `specco generate`
    and `draft.init` read it back, generating as the native directory does."""
    from specco.config_load import load_config
    from cli_helpers import save_char_tokenizer
    from specco.model.hf_io import save_policy
    from specco.runner.warmstart import initial_draft
    torch.manual_seed(0)
    policy = Policy(POLICY)
    save_policy(policy, tmp_path / "pol")
    save_char_tokenizer(tmp_path / "pol", POLICY.vocab_size)  # ids 0..99, the policy's vocabulary
    _draft().save(tmp_path / "native")
    with pytest.raises(SystemExit):  # a config error (export_any_draft), named with the flag that fixes it
        main(["export", "--draft", str(tmp_path / "native"), "--out", str(tmp_path / "x"), "--engine", "vllm"])
    assert "needs the target policy (specco export --policy)" in capsys.readouterr().err
    main(["export", "--draft", str(tmp_path / "native"), "--out", str(tmp_path / "x"), "--engine", "sglang",
          "--policy", str(tmp_path / "pol")])
    assert "DFlash draft written" in capsys.readouterr().out
    texts = generate_texts(capsys, tmp_path / "pol", [tmp_path / "native", tmp_path / "x"], 8, 4)
    assert texts[0] == texts[1] and texts[0].startswith("3+4=")
    spec = load_config(DEMO, ["draft.kind=dflash", f"draft.init={tmp_path / 'x'}"]).draft
    got = initial_draft(policy, torch.zeros(1, 4, dtype=torch.long), spec, gamma=4)
    assert torch.equal(got.state_dict()["norm.weight"], _draft().state_dict()["norm.weight"])
