"""K3Config: parsing the HF config.json, presets, TP rank shapes, and errors that name the field."""

import copy
import json

import pytest

from k3_fastpath.config import ConfigError, from_hf_dict, load_config
from k3_fastpath.manifest import tensor_specs
from k3_fastpath.presets import PRESET_NAMES, preset
from k3_fastpath.rank_shapes import rank_shapes


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_presets_round_trip_through_config_json(name, tmp_path):
    cfg = preset(name).config
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    assert load_config(tmp_path) == cfg


def test_k3_layer_structure_matches_the_published_model():
    cfg = preset("k3").config
    # MLA at 3, 7, ..., 91 and 92 (0-based): 24 layers; KDA on the other 69
    assert cfg.mla_layer_ids == list(range(3, 92, 4)) + [92]
    assert len(cfg.mla_layer_ids) == 24 and len(cfg.kda_layer_ids) == 69
    assert not cfg.is_moe_layer(0) and all(cfg.is_moe_layer(i) for i in range(1, 93))
    assert cfg.mla_latent_dim == 576 and cfg.q_head_dim == 192
    assert cfg.num_attn_res_blocks == 8  # + the running prefix = 9 AttnRes sources at most


def test_the_sentinel_has_k3s_structure_and_a_tp16_ranks_head_shapes():
    """k3-sentinel (issue #19): every K3 structural feature, K3's per-head dimensions and a TP16 rank's head
    count (so the fast path compiles the kernels it runs for K3 at TP16), tens of millions of parameters."""
    k3, s = preset("k3").config, preset("k3-sentinel").config
    r16 = rank_shapes(k3, 16)
    assert s.linear_attn_config.num_heads == s.num_attention_heads == r16.kda_heads == 6
    for field in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                  "mla_use_nope", "mla_use_output_gate", "moe_router_activation_func", "num_shared_experts",
                  "latent_moe_use_norm", "expert_format", "tie_word_embeddings", "first_k_dense_replace",
                  "activation_situ_beta", "activation_situ_linear_beta"):
        assert getattr(s, field) == getattr(k3, field), field
    assert s.linear_attn_config.head_dim == k3.linear_attn_config.head_dim == 128
    assert s.mla_latent_dim == 576 and s.q_head_dim == 192
    assert s.mla_layer_ids[-2:] == [s.num_hidden_layers - 2, s.num_hidden_layers - 1]  # two MLA layers at the end
    assert not s.is_moe_layer(0) and all(s.is_moe_layer(i) for i in range(1, s.num_hidden_layers))
    assert s.num_attn_res_blocks >= 2
    params = sum(spec.numel for spec in tensor_specs(s) if spec.dtype != "U8")  # MXFP4 scales aside
    assert 20e6 < params < 120e6, params  # tens of millions


def test_full_checkpoint_size_matches_k3_md():
    total = sum(s.nbytes for s in tensor_specs(preset("k3").config))
    assert 1.50e12 < total < 1.62e12  # "about 1.56 TB on disk"


def test_tp8_and_tp16_rank_shapes_match_the_k3_md_table():
    k3 = preset("k3").config
    t8, t16 = rank_shapes(k3, 8), rank_shapes(k3, 16)
    assert (t8.kda_heads, t16.kda_heads) == (12, 6)
    assert t8.kda_in_proj == (6288, 7168) and t16.kda_in_proj == (3216, 7168)
    assert t8.kda_o_proj == (7168, 1536) and t16.kda_o_proj == (7168, 768)
    assert t8.mla_qa_kva == t16.mla_qa_kva == (2112, 7168)
    assert (t8.mla_q_b, t8.mla_kv_b) == ((2304, 1536), (3072, 512))
    assert (t16.mla_q_b, t16.mla_kv_b) == ((1152, 1536), (1536, 512))
    assert t8.mla_gate == t8.shared_gate_up == (1536, 7168)
    assert t16.mla_gate == t16.shared_gate_up == (768, 7168)
    assert (t8.shared_down, t16.shared_down) == ((7168, 768), (7168, 384))
    assert t8.latent_down == (3584, 7168) and t8.latent_up == (7168, 3584) and t8.router == (896, 7168)
    assert (t8.lm_head, t16.lm_head) == ((20480, 7168), (10240, 7168))
    assert t8.expert_w13 == (384, 3584) and t8.expert_w2 == (3584, 384)


def test_mini_has_full_per_layer_shapes_and_fits_one_h200():
    mini, k3 = preset("k3-mini").config, preset("k3").config
    for f in ("hidden_size", "num_attention_heads", "kv_lora_rank", "moe_intermediate_size",
              "routed_expert_hidden_size", "vocab_size", "linear_attn_config"):
        if f != "linear_attn_config":
            assert getattr(mini, f) == getattr(k3, f)
    assert mini.linear_attn_config.num_heads == 96
    assert sum(s.nbytes for s in tensor_specs(mini)) < 100e9


def _raw():
    return copy.deepcopy(preset("k3-tiny").config.to_hf_dict())


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda r: r["text_config"].pop("hidden_size"), "text_config.hidden_size"),
        (lambda r: r["text_config"].update(num_experts_per_token=99), "num_experts_per_token"),
        (lambda r: r["text_config"].update(kv_lora_rank="512"), "kv_lora_rank"),
        (lambda r: r["text_config"]["linear_attn_config"].pop("kda_layers"), "linear_attn_config.kda_layers"),
        (lambda r: r["text_config"]["linear_attn_config"].update(kda_layers=[1, 2]), "kda_layers"),
        (lambda r: r["text_config"]["linear_attn_config"].update(full_attn_layers=[1, 4, 7, 8]), "listed twice"),
        (lambda r: r["text_config"]["linear_attn_config"].update(full_attn_layers=[4, 7, 9]), "outside"),
        (lambda r: r["text_config"].update(routed_expert_hidden_size=70), "routed_expert_hidden_size"),
        (lambda r: r["text_config"].update(tie_word_embeddings=True), "tie_word_embeddings"),
        (lambda r: r["text_config"].update(moe_router_activation_func="softmax"), "moe_router_activation_func"),
        (lambda r: r["text_config"]["linear_attn_config"].update(gate_lower_bound=1.0), "gate_lower_bound"),
        (lambda r: r.update(quantization_config={"format": "nvfp4-pack-quantized"}), "quantization_config"),
    ],
)
def test_invalid_configs_name_the_field(mutate, field):
    raw = _raw()
    mutate(raw)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        from_hf_dict(raw)


def test_bad_json_and_missing_file_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ConfigError, match="k3-tiny"):
        preset("k4")


def test_tp_size_that_does_not_divide_heads_is_refused():
    with pytest.raises(ConfigError, match="num_heads"):
        rank_shapes(preset("k3-tiny").config, 8)
