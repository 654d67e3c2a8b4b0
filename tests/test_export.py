"""EAGLE-3 export for vLLM / SGLang and import of published layouts (specco/export/FORMATS.md).

One test per engine checks the written config and tensor names against that engine's loader as
specco/export/FORMATS.md writes it down (including the loader's own name mapping, so a name the loader would drop
or fail on shows up here); export -> import gives bit-identical draft logits; published layouts
(EAGLE, SpecForge) import; and every refusal names what is wrong.
"""
import json
import re

import pytest
import torch

from specco.rollout.forward import RopeTable, draft_step
from safetensors.torch import load_file, save_file

from specco.cli import main
from cli_helpers import generate_texts
from specco.export import export_draft, import_draft, load_draft
from specco.export import formats
from specco.model.config import ConfigError, DraftConfig, PolicyConfig
from specco.model.draft import Eagle3Draft, build_vocab_maps
from cli_helpers import DEMO  # noqa: E402

POLICY = PolicyConfig(vocab_size=100, hidden_size=32, intermediate_size=48, num_layers=8, num_heads=4,
                      num_kv_heads=2, max_position_embeddings=256, rope_theta=5e5)


def _draft(aux=(1, 3, 4), draft_vocab=40, seed=0):
    torch.manual_seed(seed)
    dc = DraftConfig.for_policy(POLICY, draft_vocab, aux)
    dc = DraftConfig.from_dict({**dc.to_dict(), "max_position_embeddings": 64})  # < the policy's
    d = Eagle3Draft(dc)
    d2t, t2d = build_vocab_maps(torch.rand(POLICY.vocab_size), draft_vocab)
    d.set_vocab_maps(d2t, t2d)
    with torch.no_grad():
        for n, p in d.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)  # not ones: a swapped or dropped norm would show
    return d.eval()


def _logits(draft, seed=1):
    g = torch.Generator().manual_seed(seed)
    h = POLICY.hidden_size
    aux = torch.randn(2, 5, 3 * h, generator=g)
    emb = torch.randn(2, 5, h, generator=g)
    pos = torch.arange(5).expand(2, 5)
    rope = RopeTable.build(draft.cfg.head_dim, draft.cfg.rope_theta, 8, "cpu", torch.float32,
                           scaling=draft.cfg.rope_scaling)
    with torch.no_grad():
        logits, out = draft_step(draft, draft.project_taps(aux), emb, pos, draft.new_cache(2, 8), rope, prefill=True)
        logits2, _ = draft_step(draft, out[:, -1:], emb[:, -1:], pos[:, -1:] + 1, draft.new_cache(2, 8), rope)
    return draft.to_target_logits(logits), logits2


def _written(out):
    return json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))


# What each loader builds (specco/export/FORMATS.md): its parameter names and the name mapping of load_weights.
STACKED = ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
           (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj"))
LAYER_PARAMS = ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight",
                "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
                "hidden_norm.weight")


def _stack(name):
    for shard, fused in STACKED:
        if shard in name:
            return name.replace(shard, fused)
    return name


def _vllm_param(name):
    """vLLM Eagle3LlamaForCausalLM.load_weights: t2d skipped, d2t -> draft_id_to_target_id, 'model.'
    prepended unless lm_head, then LlamaModel.load_weights: midlayer. -> layers.0., q/k/v and gate/up
    stacked."""
    if "t2d" in name:
        return None
    if "d2t" in name:
        return "draft_id_to_target_id"
    if "lm_head" not in name:
        name = "model." + name
    return _stack(name.replace("midlayer.", "layers.0."))


VLLM_PARAMS = {f"model.layers.0.{p}" for p in LAYER_PARAMS} | {
    "model.fc.weight", "model.norm.weight", "lm_head.weight", "draft_id_to_target_id",
    "model.embed_tokens.weight"}  # shared from the target when the checkpoint has none


def _sglang_param(name):
    """SGLang LlamaForCausalLMEagle3.load_weights: d2t -> hot_token_id (d2t + arange), t2d skipped,
    q/k/v and gate/up stacked, 'model.' prepended when the name is not a parameter; names matching no
    parameter are silently skipped (which is why every exported name must map to one)."""
    if "d2t" in name:
        return "hot_token_id"
    if "t2d" in name:
        return None
    name = _stack(name)
    return name if name in SGLANG_PARAMS else "model." + name


SGLANG_PARAMS = {f"model.midlayer.{p}" for p in LAYER_PARAMS} | {
    "model.fc.weight", "model.norm.weight", "lm_head.weight", "model.embed_tokens.weight"}


def _check_loader_mapping(tensors, to_param, params):
    mapped = {to_param(k) for k in tensors} - {None}
    assert mapped - {"hot_token_id"} <= params, mapped - params
    assert params - mapped == {"model.embed_tokens.weight"}  # everything but the shared embedding


def test_vllm_layout(tmp_path):
    out = export_draft(_draft(), tmp_path / "vllm", "vllm", POLICY)
    cfg, t = _written(out)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    # vLLM: top-level ids are the layers whose *input* is captured: specco's outputs + 1
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["eagle_config"] == {"use_aux_hidden_state": True}
    assert (cfg["draft_vocab_size"], cfg["vocab_size"], cfg["target_hidden_size"]) == (40, 100, 32)
    assert cfg["max_position_embeddings"] == 256  # the policy's, not the draft's 64
    assert cfg["norm_before_residual"] is False and cfg["tie_word_embeddings"] is False
    assert cfg["rope_theta"] == 5e5 and cfg["head_dim"] == 8
    assert set(t) == set(formats.tensor_shapes(_draft().cfg)) and "embed_tokens.weight" not in t
    assert t["d2t"].dtype == torch.int64 and t["t2d"].dtype == torch.bool
    assert t["fc.weight"].shape == (32, 3 * cfg["target_hidden_size"])  # vLLM: fc in = 3 x target
    assert t["midlayer.self_attn.q_proj.weight"].shape == (4 * 8, 2 * 32)  # qkv over concat(emb, h)
    assert t["lm_head.weight"].shape == (cfg["draft_vocab_size"], 32)
    _check_loader_mapping(t, _vllm_param, VLLM_PARAMS)


def test_sglang_layout(tmp_path):
    out = export_draft(_draft(), tmp_path / "sglang", "sglang", POLICY)
    cfg, t = _written(out)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    # SGLang: nested ids are layer outputs (it adds 1 itself): specco's ids unchanged
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True}
    assert "eagle_aux_hidden_state_layer_ids" not in cfg
    assert cfg["bias"] is False and cfg["tie_word_embeddings"] is False  # fc bias; lm_head != embed
    assert cfg["draft_vocab_size"] == 40 and cfg["max_position_embeddings"] == 256
    assert t["fc.weight"].shape == (32, 3 * cfg["target_hidden_size"])
    assert torch.equal(t["d2t"] + torch.arange(40), _draft().draft_to_target)  # hot_token_id
    _check_loader_mapping(t, _sglang_param, SGLANG_PARAMS)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_export_import_round_trip_gives_identical_logits(tmp_path, engine):
    draft = _draft()
    out = export_draft(draft, tmp_path / engine, engine, POLICY)
    back = load_draft(out, POLICY)
    assert back.cfg == DraftConfig.from_dict({**draft.cfg.to_dict(), "max_position_embeddings": 256})
    for a, b in zip(_logits(draft), _logits(back)):
        assert torch.equal(a, b)
    # and again: the re-export of the import is the same checkpoint
    again = export_draft(back, tmp_path / f"{engine}2", engine, POLICY)
    (c1, t1), (c2, t2) = _written(out), _written(again)
    assert c1 == c2 and all(torch.equal(t1[k], t2[k]) for k in t1)
    # cross-engine: SGLang layout -> vLLM layout through the CLI
    main(["export", "--draft", str(out), "--out", str(tmp_path / "x"), "--engine", "vllm"])
    assert _written(tmp_path / "x")[0]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]


def test_export_bf16_and_specco_dir(tmp_path):
    draft = _draft()
    draft.save(tmp_path / "specco")
    out = export_draft(load_draft(tmp_path / "specco"), tmp_path / "bf16", "vllm", dtype="bfloat16")
    cfg, t = _written(out)
    assert cfg["torch_dtype"] == "bfloat16" and t["fc.weight"].dtype == torch.bfloat16
    assert t["d2t"].dtype == torch.int64 and cfg["max_position_embeddings"] == 64  # no policy given


def _published(tmp_path, name, keys_prefix="midlayer.", embed=True, maps=True, cfg_over=None, bin_=False,
               draft_vocab=40):
    """A draft directory laid out as EAGLE / SpecForge publish them, from our draft's weights."""
    draft = _draft(draft_vocab=draft_vocab)
    sd = {k.replace("midlayer.", keys_prefix): v.clone() for k, v in draft.state_dict().items()}
    if embed:
        sd["embed_tokens.weight"] = torch.randn(100, 32)
    if not maps:
        del sd["d2t"], sd["t2d"]
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 32,
           "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4,
           "num_key_value_heads": 2, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 5e5,
           "max_position_embeddings": 2048, "vocab_size": 100, "draft_vocab_size": draft_vocab,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", **(cfg_over or {})}
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    if bin_:
        torch.save(sd, d / "pytorch_model.bin")
    else:
        save_file({k: v.contiguous() for k, v in sd.items()}, str(d / "model.safetensors"))
    return d, draft


def test_import_published_layouts(tmp_path):
    # SpecForge: midlayer.* + the frozen embed_tokens, ids in eagle_config (SGLang convention)
    d, ref = _published(tmp_path, "specforge", cfg_over={"eagle_config": {
        "eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True}})
    got = import_draft(d, POLICY)
    assert got.cfg.aux_layer_ids == (1, 3, 4) and torch.equal(_logits(got)[0], _logits(ref)[0])
    # EAGLE (SafeAILab): pytorch_model.bin, no aux ids -> the engines' default (2, L//2, L-3) inputs
    d, ref = _published(tmp_path, "eagle", bin_=True)
    assert import_draft(d, POLICY).cfg.aux_layer_ids == (1, 3, 4) == formats.engine_default_aux_ids(8)
    with pytest.raises(ConfigError, match="pass the policy config"):
        import_draft(d)
    # vLLM-style ids at the top level, layers.0.* names
    d, ref = _published(tmp_path, "vllm", keys_prefix="layers.0.",
                        cfg_over={"eagle_aux_hidden_state_layer_ids": [3, 5, 6]})
    assert import_draft(d, POLICY).cfg.aux_layer_ids == (2, 4, 5)
    # full draft vocabulary without d2t / t2d (SpecForge omits them): identity maps
    d, ref = _published(tmp_path, "full", maps=False, draft_vocab=100)
    got = import_draft(d, POLICY)
    assert torch.equal(got.draft_to_target, torch.arange(100)) and bool(got.t2d.all())
    assert torch.equal(_logits(got)[0], _logits(ref)[0])
    d, _ = _published(tmp_path, "nomaps", maps=False)  # a cut vocabulary needs d2t
    with pytest.raises(ValueError, match="no d2t although draft_vocab_size=40"):
        import_draft(d, POLICY)


@pytest.mark.parametrize("over,needle", [
    ({"num_hidden_layers": 2}, "num_hidden_layers=2"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"norm_before_residual": True}, "norm_before_residual=True"),
    ({"fc_norm": True}, "fc_norm=True"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings=True"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"rope_scaling": {"rope_type": "longrope"}}, "rope_scaling.rope_type='longrope'"),
    ({"target_hidden_size": 64}, "target_hidden_size=64"),
    ({"architectures": ["Eagle3Speculator"]}, "architectures"),
    ({"eagle_aux_hidden_state_layer_ids": [2, 4, 5],
      "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}}, "name different layers"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3]}}, "exactly 3"),
    ({"vocab_size": 101}, "vocab_size 101 != policy vocab_size 100"),
])
def test_import_refusals(tmp_path, over, needle):
    d, _ = _published(tmp_path, "bad", cfg_over=over)
    with pytest.raises((ConfigError, ValueError)) as e:
        import_draft(d, POLICY)
    assert needle in str(e.value)


def test_import_tensor_refusals(tmp_path):
    d, draft = _published(tmp_path, "t")
    sd = load_file(str(d / "model.safetensors"))
    for name, change, needle in [
        ("missing", lambda s: s.pop("norm.weight"), "missing tensors ['norm.weight']"),
        ("extra", lambda s: s.update({"midlayer.self_attn.rotary.x": torch.ones(1)}), "unexpected"),
        ("shape", lambda s: s.update({"fc.weight": torch.ones(32, 64)}), "wrong shape"),
        ("t2d", lambda s: s.update({"t2d": ~s["t2d"]}), "t2d does not mark"),
        ("d2t", lambda s: s.update({"d2t": torch.zeros(40, dtype=torch.long) + 90}), "d2t maps"),
    ]:
        bad = dict(sd)
        change(bad)
        save_file(bad, str(d / "model.safetensors"))
        with pytest.raises(ValueError, match=re.escape(needle)):
            import_draft(d, POLICY)


def test_export_refusals_and_atomic_write(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="exactly 3 aux layers"):
        export_draft(_draft(aux=(1, 3)), tmp_path / "two", "vllm")
    with pytest.raises(ConfigError, match="engine 'tgi'"):
        export_draft(_draft(), tmp_path / "x", "tgi")
    small = PolicyConfig(vocab_size=100, hidden_size=32, intermediate_size=48, num_layers=4,
                         num_heads=4, num_kv_heads=2)
    with pytest.raises(ConfigError, match=r"aux layers \[4\] outside"):
        export_draft(_draft(), tmp_path / "x", "vllm", small)
    out = export_draft(_draft(), tmp_path / "ok", "vllm")
    with pytest.raises(FileExistsError):
        export_draft(_draft(), out, "vllm")
    # a failure after the files are written leaves neither a checkpoint nor a temporary directory
    monkeypatch.setattr(formats, "check_export", lambda *a, **k: (_ for _ in ()).throw(ValueError("boom")))
    with pytest.raises(ValueError, match="boom"):
        export_draft(_draft(), tmp_path / "half", "sglang")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok"]
    with pytest.raises(ValueError, match="boom"):  # --force: the old checkpoint survives a failure
        export_draft(_draft(seed=3), out, "vllm", overwrite=True)
    assert torch.equal(_written(out)[1]["fc.weight"], _draft().state_dict()["fc.weight"])


def test_check_export_names_what_is_wrong():
    dc = _draft().cfg
    eng = formats.ENGINES["vllm"]
    cfg = formats.engine_config(dc, eng, 256, "float32")
    shapes = formats.tensor_shapes(dc)
    dtypes = {k: "float32" for k in shapes} | {"d2t": "int64", "t2d": "bool"}
    formats.check_export(cfg, shapes, dtypes, dc, eng, 256)
    for key in ("draft_vocab_size", "eagle_aux_hidden_state_layer_ids", "target_hidden_size"):
        with pytest.raises(ValueError, match=key):
            formats.check_export({k: v for k, v in cfg.items() if k != key}, shapes, dtypes, dc, eng, 256)
    with pytest.raises(ValueError, match="clamp"):
        formats.check_export(cfg, shapes, dtypes, dc, eng, 512)
    with pytest.raises(ValueError, match="embed_tokens"):
        formats.check_export(cfg, shapes | {"embed_tokens.weight": (100, 32)}, dtypes, dc, eng, 256)
    with pytest.raises(ValueError, match="d2t must be int64"):
        formats.check_export(cfg, shapes, dtypes | {"d2t": "int32"}, dc, eng, 256)


def test_export_reads_state_dict_not_parameters(tmp_path):
    """Keys come from state_dict(): a module whose parameters are fused but whose state_dict keeps the
    HF names exports fine; a state_dict key the layout does not define is refused."""
    draft = _draft()
    sd = draft.state_dict()
    draft.state_dict = lambda *a, **k: {**sd}  # stand-in: same HF-named keys
    export_draft(draft, tmp_path / "a", "vllm")
    draft.state_dict = lambda *a, **k: {**sd, "midlayer.self_attn.qkv_proj.weight": torch.ones(1)}
    with pytest.raises(ValueError, match="qkv_proj"):
        export_draft(draft, tmp_path / "b", "vllm")


def test_draft_init_config_key(tmp_path):
    """`draft.init=DIR` starts the warm start from an imported draft, checked against the policy."""
    from specco.config_load import load_config
    from specco.model.policy import Policy
    from specco.runner.warmstart import initial_draft
    policy = Policy(POLICY)
    tokens = torch.randint(0, 100, (2, 8))
    src = _draft()
    out = export_draft(src, tmp_path / "sg", "sglang", POLICY)
    assert load_config(DEMO).draft.init == ""
    got = initial_draft(policy, tokens, load_config(DEMO, [f"draft.init={out}", "draft.aux_layer_ids=[]"]).draft)
    assert torch.equal(_logits(got)[0], _logits(src)[0])
    same = load_config(DEMO, [f"draft.init={out}", "draft.aux_layer_ids=1,3,4", "draft.draft_vocab_size=40"])
    assert initial_draft(policy, tokens, same.draft).cfg.aux_layer_ids == (1, 3, 4)
    for bad, needle in (("draft.aux_layer_ids=1,2,3", "draft.aux_layer_ids=(1, 2, 3)"),
                        ("draft.draft_vocab_size=10", "draft.draft_vocab_size=10")):
        with pytest.raises(ConfigError, match=re.escape(needle)):
            initial_draft(policy, tokens, load_config(DEMO, [f"draft.init={out}", bad]).draft)
    with pytest.raises(FileNotFoundError, match="not a draft directory"):
        initial_draft(policy, tokens, load_config(DEMO, [f"draft.init={tmp_path / 'nope'}", "draft.aux_layer_ids=[]"]).draft)
    other = Policy(PolicyConfig(vocab_size=120, hidden_size=32, intermediate_size=48, num_layers=8,
                                num_heads=4, num_kv_heads=2))
    with pytest.raises(ConfigError, match="vocab_size 100 != policy vocab_size 120"):
        initial_draft(other, tokens, load_config(DEMO, [f"draft.init={out}", "draft.aux_layer_ids=[]"]).draft)
    assert initial_draft(policy, tokens, load_config(DEMO).draft).cfg.draft_vocab_size == 100  # new draft


@pytest.mark.e2e
def test_generate_with_exported_draft(tmp_path, capsys):
    """`specco generate --draft` reads an exported (or published) layout: same greedy text as with
    specco's own draft directory."""
    from cli_helpers import save_char_tokenizer
    from specco.model.hf_io import save_policy
    from specco.model.policy import Policy
    torch.manual_seed(0)
    save_policy(Policy(POLICY), tmp_path / "pol")
    save_char_tokenizer(tmp_path / "pol", POLICY.vocab_size)  # ids 0..99, the policy's vocabulary
    draft = _draft()
    draft.save(tmp_path / "native")
    export_draft(draft, tmp_path / "vllm", "vllm", POLICY)
    texts = generate_texts(capsys, tmp_path / "pol", [tmp_path / "native", tmp_path / "vllm"], 6, 2)
    assert texts[0] == texts[1] and texts[0].startswith("3+4=")


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_engines_see_the_fields_through_transformers(tmp_path, engine):
    """Both engines read the draft config with transformers' AutoConfig (`hf_config`): the fields
    their loaders use must survive it, with RoPE as transformers 5 stores it."""
    transformers = pytest.importorskip("transformers")
    out = export_draft(_draft(), tmp_path / engine, engine, POLICY)
    c = transformers.AutoConfig.from_pretrained(str(out))
    assert type(c).__name__ == "LlamaConfig" and c.architectures == ["LlamaForCausalLMEagle3"]
    assert (c.draft_vocab_size, c.target_hidden_size, c.vocab_size, c.head_dim) == (40, 32, 100, 8)
    assert c.rope_parameters == {"rope_type": "default", "rope_theta": 5e5}
    assert c.norm_before_residual is False and c.tie_word_embeddings is False
    if engine == "vllm":
        assert list(c.eagle_aux_hidden_state_layer_ids) == [2, 4, 5]
    else:
        assert c.eagle_config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
