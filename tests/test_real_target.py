"""A real pretrained target, SmolLM2-135M-Instruct (Llama architecture, tied embeddings, a 49,152-token vocabulary
that fills its embedding, no mask token): loaded from its GGUF file or a model directory, the mask token chosen
from its special tokens, and a drafter trained on it, exported and read back."""
import json
from pathlib import Path
import pytest, torch
from conftest import train_cli
from dflash.bench.real import smollm2_gguf
from dflash.model.drafter import DFlashDrafter
from dflash.data.features import TargetFeatures
from dflash.model.target import check_target_dir, target_identity
from dflash.model.target import target_problems
from dflash.bench.harness import launch_train
from dflash.model.target import frozen_head_weights

TINY = ['--num-layers', '1', '--num-anchors', '8', '--max-length', '128', '--batch-size', '2', '--max-steps', '1',
        '--spec-eval-prompts', '0', '--progress-bar', 'false', '--report-to', 'none']


def chats(path: Path, n: int = 4, say: str = '') -> Path:
    "`n` short chat records, the assistant's reply ending with `say`."
    recs = [{'messages': [{'role': 'user', 'content': f'Add {i} to x in Python.'},
                          {'role': 'assistant', 'content': f'def add(x):\n    return x + {i}{say}'}]} for i in range(n)]
    path.write_text(''.join(json.dumps(r) + '\n' for r in recs))
    return path


@pytest.fixture(scope='module')
def gguf_features():
    "SmolLM2 read from its GGUF file (dequantized by transformers), its two middle layers."
    return TargetFeatures(smollm2_gguf(), layer_ids=[9, 19], device='cpu')


def test_a_gguf_target_is_the_model_its_directory_holds(smollm2, gguf_features):
    assert target_problems(smollm2_gguf()) == []
    config = check_target_dir(smollm2_gguf())
    assert (config.model_type, config.num_hidden_layers, config.vocab_size, config.tie_word_embeddings) == \
        ('llama', 30, 49152, True)
    ids = torch.tensor([[1, 9690, 198, 28120, 905, 2]])
    from_dir = TargetFeatures(smollm2, layer_ids=[9, 19], device='cpu')
    assert torch.equal(gguf_features(ids), from_dir(ids))                  # the same weights, dequantized alike
    embed, head = frozen_head_weights(smollm2_gguf())                        # read from the file, no model loaded
    assert torch.equal(embed, from_dir.embed_weight) and head is embed        # tied: one matrix
    assert gguf_features.lm_head_weight.data_ptr() == gguf_features.embed_weight.data_ptr()
    assert target_identity(smollm2_gguf()) == target_identity(smollm2_gguf()) != target_identity(smollm2)


@pytest.mark.parametrize('command', [['dflash.speculate', '--drafter', 'DRAFTER'], ['dflash.data', 'cache', '--out', 'OUT'],
                                     ['dflash.train', '--out', 'OUT']], ids=['speculate', 'data-cache', 'train'])
def test_a_gguf_with_no_architecture_is_named_in_every_command(tmp_path, command):
    "A GGUF header whose metadata lacks general.architecture: exit 2 and one line naming the file and the remedy."
    import struct, subprocess, sys
    from dflash.core.files import assets_dir
    bad = tmp_path / 'model.gguf'
    bad.write_bytes(b'GGUF' + struct.pack('<IQQ', 3, 0, 0))               # version 3, no tensors, no metadata
    args = [str(assets_dir() / 'toy-drafter') if a == 'DRAFTER' else str(tmp_path / 'out') if a == 'OUT' else a
            for a in command[1:]]
    r = subprocess.run([sys.executable, '-m', command[0], *args, '--target', str(bad), '--data',
                        str(chats(tmp_path / 'd.jsonl'))], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"{bad}: its metadata has no general.architecture" in r.stderr and 'Traceback' not in r.stderr, r.stderr


def test_a_file_that_is_no_gguf_is_named_before_anything_loads(tmp_path):
    (tmp_path / 'model.gguf').write_bytes(b'\x00' * 64)
    (bad,) = target_problems(tmp_path / 'model.gguf')
    assert 'not a GGUF file' in bad and str(tmp_path / 'model.gguf') in bad


def test_train_on_the_gguf_file_with_no_other_option(tmp_path):
    "The acceptance run: `--target model.gguf --data F` and nothing else; the mask token is chosen and said."
    r = launch_train(tmp_path / 'run', '--target', str(smollm2_gguf()), '--data', str(chats(tmp_path / 'd.jsonl', 8)),
                     timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "mask token '<empty_output>' (id 16)" in r.stdout
    conf = json.loads((tmp_path / 'run' / 'drafter' / 'config.json').read_text())
    assert (conf['dflash_config']['mask_token_id'], conf['num_hidden_layers'], conf['vocab_size']) == (16, 5, 49152)


def test_mask_token_avoids_what_the_data_uses_and_the_drafter_reloads(tmp_path, smollm2):
    data = chats(tmp_path / 'd.jsonl', say=' <empty_output>')               # the data uses SmolLM2's last special token
    r = launch_train(tmp_path / 'run', '--target', str(smollm2), '--data', str(data), *TINY, '--init-from-target')
    assert r.returncode == 0, r.stdout + r.stderr
    assert "mask token '<jupyter_script>' (id 15)" in r.stdout               # the one before it
    assert "drafter layers start from the target's top layers: 9 weights" in r.stdout   # Llama: no q_norm, k_norm
    drafter = DFlashDrafter.from_pretrained(tmp_path / 'run' / 'drafter')
    assert drafter.config.mask_token_id == 15
    from safetensors import safe_open
    with safe_open(tmp_path / 'run' / 'drafter' / 'model.safetensors', 'pt') as f:
        assert not [k for k in f.keys() if 'embed' in k or 'lm_head' in k]   # the target's frozen, tied matrix stays out
    refused = train_cli('--out', tmp_path / 'again', '--target', smollm2, '--data', data, *TINY, '--mask-token-id', 16)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "mask token id 16 ('<empty_output>'): the training data uses it" in refused.stdout + refused.stderr
    assert 'Traceback' not in refused.stdout + refused.stderr
    assert not (tmp_path / 'again' / 'run.json').exists()


def test_mask_token_id_outside_the_vocabulary_is_refused_with_the_options(tmp_path, smollm2):
    r = train_cli('--out', tmp_path / 'run', '--target', smollm2, '--data', chats(tmp_path / 'd.jsonl'),
                  '--mask-token-id', 49152)
    assert r.returncode == 2
    assert '--mask-token-id = 49152: allowed 0..49151' in r.stdout + r.stderr
