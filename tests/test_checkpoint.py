"Interop of the drafter checkpoint format: save, load, names, and bad directories."
import json
import pytest, torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, Qwen3Config, LlamaConfig
from dflash.model.config import DrafterConfig
from dflash.model.drafter import DFlashDrafter
from dflash.model.layout import BlockLayout


def _batch(cfg, S=32):
    ids = torch.randint(0, cfg.vocab_size - 1, (2, S))
    lm = torch.ones(2, S, dtype=torch.bool)
    lay = BlockLayout.from_batch(ids, lm, mask_token_id=cfg.mask_token_id, block_size=cfg.block_size, num_anchors=6)
    return torch.randn(2, S, cfg.context_size), lay, torch.randn(cfg.vocab_size, cfg.hidden_size)


def test_save_load_identical_outputs(tmp_path, small_config):
    d = DFlashDrafter(small_config)
    ctx, lay, emb = _batch(small_config)
    d.save_pretrained(tmp_path / 'd')
    back = DFlashDrafter.from_pretrained(tmp_path / 'd')
    assert back.config == small_config
    with torch.no_grad():
        assert torch.equal(d(ctx, lay, emb), back(ctx, lay, emb))
        assert torch.equal(d.draft_block(ctx[:, :5], lay.block_ids[:, 0], emb),
                           back.draft_block(ctx[:, :5], lay.block_ids[:, 0], emb))
    assert not list(tmp_path.glob('d/.*')), "no temporary files left behind"


def test_names_and_config_fields(tmp_path, small_config):
    DFlashDrafter(small_config).save_pretrained(tmp_path)
    names = set(load_file(tmp_path / 'model.safetensors'))
    expected = {'fc.weight', 'hidden_norm.weight', 'norm.weight'}
    for i in range(2):
        expected |= {f'layers.{i}.input_layernorm.weight', f'layers.{i}.post_attention_layernorm.weight',
                     f'layers.{i}.self_attn.q_norm.weight', f'layers.{i}.self_attn.k_norm.weight'}
        expected |= {f'layers.{i}.self_attn.{p}_proj.weight' for p in 'qkvo'}
        expected |= {f'layers.{i}.mlp.{p}_proj.weight' for p in ('gate', 'up', 'down')}
    assert names == expected
    conf = json.loads((tmp_path / 'config.json').read_text())
    assert conf['architectures'] == ['DFlashDraftModel'] and conf['model_type'] == 'qwen3'
    assert conf['dflash_config'] == {'mask_token_id': 127, 'target_layer_ids': small_config.target_layer_ids}
    assert (conf['block_size'], conf['num_target_layers'], conf['sliding_window']) == (4, 6, 6)
    assert conf['layer_types'] == ['full_attention', 'sliding_attention']
    for f in ('hidden_size', 'num_attention_heads', 'num_key_value_heads', 'head_dim', 'intermediate_size',
              'vocab_size', 'num_hidden_layers', 'rms_norm_eps', 'rope_theta', 'max_position_embeddings'):
        assert f in conf, f
    # transformers reads it as a Qwen3 config with the same sizes
    hf = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(hf, Qwen3Config) and hf.hidden_size == 64 and hf.num_key_value_heads == 2


def test_fc_shapes_follow_layer_ids(small_config):
    cfg = DrafterConfig(**{**small_config.__dict__, 'target_layer_ids': [0, 2, 4]})
    assert DFlashDrafter(cfg).fc.weight.shape == (64, 3 * 64)


@pytest.mark.parametrize('problem', ['missing', 'extra', 'shape'])
def test_bad_tensors_are_named(tmp_path, small_config, problem):
    DFlashDrafter(small_config).save_pretrained(tmp_path)
    state = load_file(tmp_path / 'model.safetensors')
    name = 'layers.1.self_attn.k_proj.weight'
    if problem == 'missing': del state[name]
    if problem == 'extra': state['layers.2.mlp.up_proj.weight'] = torch.zeros(3)
    if problem == 'shape': state[name] = torch.zeros(7, 64)
    save_file(state, tmp_path / 'model.safetensors')
    expect = {'missing': f"missing tensor '{name}'", 'extra': "unexpected tensor 'layers.2.mlp.up_proj.weight'",
              'shape': f"tensor '{name}' has shape (7, 64), config.json implies (32, 64)"}[problem]
    with pytest.raises(ValueError, match=expect.replace('(', r'\(').replace(')', r'\)')):
        DFlashDrafter.from_pretrained(tmp_path)


def test_not_a_drafter_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match='no config.json'):
        DFlashDrafter.from_pretrained(tmp_path)
    Qwen3Config(hidden_size=32, num_attention_heads=2).save_pretrained(tmp_path)
    save_file({'x': torch.zeros(1)}, tmp_path / 'model.safetensors')
    with pytest.raises(ValueError, match="config.json: no 'dflash_config' field"):
        DFlashDrafter.from_pretrained(tmp_path)


def test_published_style_bf16_checkpoint_loads(tmp_path, small_config):
    "A published drafter: bf16 weights, old RoPE fields only, no rope_parameters."
    d = DFlashDrafter(small_config).to(torch.bfloat16)
    d.save_pretrained(tmp_path)
    conf = json.loads((tmp_path / 'config.json').read_text())
    del conf['rope_parameters']
    (tmp_path / 'config.json').write_text(json.dumps(conf))
    back = DFlashDrafter.from_pretrained(tmp_path)
    assert back.fc.weight.dtype == torch.bfloat16
    assert back.config.rope_parameters == small_config.rope_parameters
    assert DFlashDrafter.from_pretrained(tmp_path, dtype=torch.float32).fc.weight.dtype == torch.float32


@pytest.mark.parametrize('make', [
    lambda: Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=200),
    lambda: LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                        num_key_value_heads=1, vocab_size=200)])
def test_from_target_config_on_disk(tmp_path, make):
    "A target's config.json on disk, read by transformers, gives a working drafter."
    make().save_pretrained(tmp_path)
    cfg = DrafterConfig.from_target(AutoConfig.from_pretrained(tmp_path), mask_token_id=199, num_hidden_layers=3,
                                    block_size=4)
    assert cfg.target_layer_ids == [1, 3, 5] and cfg.head_dim == 16
    d = DFlashDrafter(cfg)
    ctx, lay, emb = _batch(cfg)
    assert d(ctx, lay, emb).shape == (2, lay.num_blocks * 4, 64)


@pytest.mark.parametrize('edit,expect', [
    (lambda c: {**c, 'hidden_size': 'abc'}, "fields that must be numbers are not: hidden_size='abc'"),
    (lambda c: {**c, 'num_attention_heads': 4.0}, "num_attention_heads=4.0"),
    (lambda c: {**c, 'rms_norm_eps': 'small'}, "rms_norm_eps"),
    (lambda c: {**c, 'dflash_config': {**c['dflash_config'], 'target_layer_ids': '1,3'}},
     "dflash_config.target_layer_ids='1,3'")])
def test_non_numeric_config_fields_are_named(tmp_path, small_config, edit, expect):
    DFlashDrafter(small_config).save_pretrained(tmp_path)
    conf = json.loads((tmp_path / 'config.json').read_text())
    (tmp_path / 'config.json').write_text(json.dumps(edit(conf)))
    with pytest.raises(ValueError, match='config.json: fields that must be numbers') as e:
        DFlashDrafter.from_pretrained(tmp_path)
    assert expect in str(e.value)


@pytest.mark.parametrize('edit,expect', [
    (lambda c: {**c, 'rope_theta': 'big'}, "fields that must be numbers are not: rope_theta='big'"),
    (lambda c: {**c, 'rope_scaling': 3}, "rope_scaling must be an object, got 3"),
    (lambda c: {**{k: v for k, v in c.items() if k not in ('rope_theta', 'rope_parameters')}}, None),
    (lambda c: {**c, 'dflash_config': 3, 'mask_token_id': 7}, None)])
def test_hostile_rope_and_dflash_fields_are_named_or_read(tmp_path, small_config, edit, expect):
    """A rope field of the wrong type is named; a config without rope_theta gets the default theta, and one whose
    dflash_config is no object is read without it (its mask token from the top level)."""
    DFlashDrafter(small_config).save_pretrained(tmp_path)
    conf = json.loads((tmp_path / 'config.json').read_text())
    (tmp_path / 'config.json').write_text(json.dumps(edit(conf)))
    if expect is None:
        DFlashDrafter.from_pretrained(tmp_path)
        return
    with pytest.raises(ValueError, match=expect): DFlashDrafter.from_pretrained(tmp_path)


def test_garbage_config_and_truncated_weights_are_named(tmp_path, small_config):
    DFlashDrafter(small_config).save_pretrained(tmp_path)
    good = (tmp_path / 'config.json').read_text()
    (tmp_path / 'config.json').write_text(good[:40])
    with pytest.raises(ValueError, match='config.json: not valid JSON'): DFlashDrafter.from_pretrained(tmp_path)
    (tmp_path / 'config.json').write_text(good)
    w = tmp_path / 'model.safetensors'
    w.write_bytes(w.read_bytes()[:-10])
    with pytest.raises(ValueError, match='model.safetensors: unreadable, truncated or not safetensors'):
        DFlashDrafter.from_pretrained(tmp_path)
