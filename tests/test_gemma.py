"""A Gemma-family target: token embeddings scaled by sqrt(hidden_size), a tied LM head, sliding-window layers. A tiny
random Gemma 3 trains online and from a cache, exports, and decodes with greedy's tokens; the drafter drafts what a
loop that embeds through the target's own embedding module drafts. With Gemma 3's full vocabulary of 262,144 tokens it
plans, trains, and trains over a pruned draft vocabulary."""
import pytest, torch
from dflash.core.files import toy_data_dir
from dflash.model.drafter import DFlashDrafter
from dflash.decoding.loop import greedy_generate, speculative_generate
from conftest import train_cli

SMALL = ['--num-layers', '2', '--num-anchors', '8', '--max-length', '96', '--batch-size', '2', '--micro-batch-size', '1',
         '--lr', '3e-3', '--attention', 'eager', '--log-every', '1', '--eval-every', '0', '--eval-samples', '4',
         '--spec-eval-prompts', '0', '--seed', '3', '--threads', '1']


def _gemma(root, tokenizer, vocab_size: int):
    "A random Gemma3ForCausalLM of `vocab_size` rows (tied head), saved in `root` with `tokenizer` (ChatML)."
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    torch.manual_seed(0)
    config = Gemma3TextConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, vocab_size=vocab_size, sliding_window=32,
                              max_position_embeddings=4096, tie_word_embeddings=True)
    Gemma3ForCausalLM(config).save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


@pytest.fixture(scope='module')
def gemma(tmp_path_factory, chat_tokenizers):
    return _gemma(tmp_path_factory.mktemp('gemma3'), chat_tokenizers['chatml'], 448)


@pytest.fixture(scope='module')
def gemma_runs(gemma, tmp_path_factory):
    "{'online', 'cached'}: a few steps trained on the target, and from its cache."
    root = tmp_path_factory.mktemp('gemma-runs')
    data = toy_data_dir() / 'train.jsonl'
    online = train_cli('--target', gemma, '--data', data, '--out', root / 'online', '--max-steps', '3', *SMALL)
    assert online.returncode == 0, online.stdout[-3000:] + online.stderr[-3000:]
    cache = train_cli('cache', '--target', gemma, '--data', data, '--out', root / 'cache', '--layers', '2',
                      '--max-length', '96', '--threads', '1', module='dflash.data')
    assert cache.returncode == 0, cache.stdout[-3000:] + cache.stderr[-3000:]
    cached = train_cli('--target', gemma, '--cache', root / 'cache', '--out', root / 'cached', '--max-steps', '3',
                       *SMALL)
    assert cached.returncode == 0, cached.stdout[-3000:] + cached.stderr[-3000:]
    return {'online': root / 'online', 'cached': root / 'cached'}


def _prompt(tok, text: str) -> torch.Tensor:
    return torch.tensor([tok.apply_chat_template([{'role': 'user', 'content': text}], add_generation_prompt=True,
                                                 return_dict=True)['input_ids']])


@pytest.mark.parametrize('mode', ['online', 'cached'])
def test_a_gemma_drafter_trains_exports_and_decodes_greedy_exactly(gemma, gemma_runs, mode):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    target = AutoModelForCausalLM.from_pretrained(gemma, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(gemma)
    drafter = DFlashDrafter.from_pretrained(gemma_runs[mode] / 'drafter').eval()
    assert target.config.model_type == 'gemma3_text' and drafter.config.block_size == 16
    for q in ('Name three colours.', 'What is the capital of France?'):
        ids = _prompt(tok, q)
        spec = speculative_generate(target, drafter, ids, max_new_tokens=24, stop_token_ids=[tok.eos_token_id])
        assert spec.tokens == greedy_generate(target, ids, 24, [tok.eos_token_id]), q


def test_the_drafter_drafts_what_the_published_loop_drafts(gemma, gemma_runs):
    """The published DFlash loop embeds the block as `target.model.embed_tokens(block)` (Gemma scales it there by
    sqrt(64) = 8): the trained drafter's outputs on that embedding equal those of the block dflash's loop embeds."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    target = AutoModelForCausalLM.from_pretrained(gemma, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(gemma)
    drafter = DFlashDrafter.from_pretrained(gemma_runs['online'] / 'drafter').eval()
    seen = []
    draft_block = drafter.draft_block
    def spy(ctx, block, embed, cache=None):
        seen.append((ctx, block.clone(), embed))
        return draft_block(ctx, block, embed, cache)
    drafter.draft_block = spy
    speculative_generate(target, drafter, _prompt(tok, 'Write a haiku about the sea.'), max_new_tokens=8,
                         stop_token_ids=[tok.eos_token_id])
    del drafter.draft_block
    assert seen
    ctx, block, embed = seen[0]
    with torch.no_grad():
        ours = drafter.draft_block(ctx, block, embed)                                    # (1, B, H)
        theirs = drafter.draft_block(ctx, block, target.model.embed_tokens)              # the published loop's
        raw = drafter.draft_block(ctx, block, target.get_input_embeddings().weight)      # unscaled rows
    assert embed.scale == pytest.approx(8.0)
    assert (ours - theirs).abs().max() <= 1e-5
    assert (theirs - raw).abs().max() > 1e-2                                             # the scale is there to miss


@pytest.fixture(scope='module')
def gemma_262k(tmp_path_factory, chat_tokenizers):
    "Gemma 3's vocabulary: 262,144 rows, tied; the tokenizer uses the first few hundred."
    return _gemma(tmp_path_factory.mktemp('gemma3-262k'), chat_tokenizers['chatml'], 262_144)


def test_a_262k_vocabulary_plans(gemma_262k):
    r = train_cli('--target-config', gemma_262k, '--seq-len', '4096', '--anchors', '256', '--memory', '24GiB', '--layers', '2',
                  module='dflash.plan')
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert 'use --checkpointing' in r.stdout, r.stdout


@pytest.mark.parametrize('draft_vocab', [None, 4096])
def test_a_262k_vocabulary_trains_whole_and_pruned(gemma_262k, tmp_path, draft_vocab):
    "A few steps over the whole vocabulary, and over the 4,096 tokens the data supervises most (d2t maps them back)."
    from safetensors import safe_open
    pruned = [] if draft_vocab is None else ['--draft-vocab-size', str(draft_vocab)]
    r = train_cli('--target', gemma_262k, '--data', toy_data_dir() / 'train.jsonl', '--out', tmp_path / 'run',
                  '--max-steps', '2', *SMALL, *pruned)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    drafter = DFlashDrafter.from_pretrained(tmp_path / 'run' / 'drafter')
    assert drafter.config.vocab_size == 262_144
    with safe_open(tmp_path / 'run' / 'drafter' / 'model.safetensors', framework='pt') as f:
        names = set(f.keys())
    assert ('d2t' in names) == (draft_vocab is not None), names
