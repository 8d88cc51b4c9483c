"Chat JSONL → tokens and assistant loss masks; the target wrapper; collation and the loader; bad input."
import json
from pathlib import Path
import numpy as np
import pytest, torch
import dflash
from conftest import END_OF_TURN, chat_sentence
from dflash.data.chat import ChatDataset, tokenize_conversation
from dflash.data.records import DataStats, read_jsonl, to_messages
from dflash.core.errors import DataError
from dflash.data.templates import tokenize_chat
from dflash.data.chat import collate
from dflash.data.features import TargetFeatures
from dflash.model.layout import BlockLayout


def _conversation(rng, system=True, turns=3):
    msgs = [{'role': 'system', 'content': chat_sentence(rng)}] if system else []
    for _ in range(turns):
        msgs += [{'role': 'user', 'content': chat_sentence(rng)}, {'role': 'assistant', 'content': chat_sentence(rng)}]
    return msgs


def _record(msgs, shape):
    if shape == 'messages': return {'messages': msgs}
    names = {'user': 'human', 'assistant': 'gpt', 'system': 'system'}
    return {'conversations': [{'from': names[m['role']], 'value': m['content']} for m in msgs]}


def _write(path, lines):
    path.write_text(''.join((l if isinstance(l, str) else json.dumps(l)) + '\n' for l in lines))
    return path


def _masked_runs(tok, ids, mask):
    "The decoded text of each contiguous run of loss-masked tokens."
    m = mask.int().numpy()
    runs = np.split(np.arange(len(m)), np.flatnonzero(np.diff(m)) + 1)
    return [tok.decode(ids[r].tolist()) for r in runs if m[r[0]]]


@pytest.mark.parametrize('template', ['chatml', 'llama3'])
@pytest.mark.parametrize('shape', ['messages', 'sharegpt'])
def test_loss_mask_is_assistant_content_and_end_of_turn(tmp_path, chat_tokenizers, template, shape):
    tok, rng = chat_tokenizers[template], np.random.default_rng(1)
    convs = [_conversation(rng, system=i % 2 == 0, turns=1 + i % 3) for i in range(6)]
    ds = ChatDataset.from_jsonl(_write(tmp_path / 'd.jsonl', [_record(c, shape) for c in convs]), tok)
    assert len(ds) == 6 and ds.stats.samples == 6
    for i, c in enumerate(convs):
        s = ds[i]
        want = [m['content'] + END_OF_TURN[template] for m in c if m['role'] == 'assistant']
        assert _masked_runs(tok, s['input_ids'], s['loss_mask']) == want
        assert s['input_ids'].tolist() == tok.apply_chat_template(c, tokenize=True)['input_ids']
        assert s['sample_id'] == i
    assert ds.stats.supervised_tokens == sum(int(ds[i]['loss_mask'].sum()) for i in range(6))


def test_generation_markers_give_the_same_mask(chat_tokenizers):
    msgs = _conversation(np.random.default_rng(2))
    assert [t.tolist() for t in tokenize_chat(chat_tokenizers['chatml_generation'], msgs)] == \
           [t.tolist() for t in tokenize_chat(chat_tokenizers['chatml'], msgs)]


@pytest.mark.parametrize('template', ['chatml', 'llama3', 'chatml_generation'])
def test_truncated_reply_supervises_its_tokens_but_not_the_end_of_turn(tmp_path, chat_tokenizers, template):
    "A reply marked `truncated` (cut at the token limit) keeps its tokens supervised, not the end of turn appended."
    tok, rng = chat_tokenizers[template], np.random.default_rng(4)
    msgs = _conversation(rng, turns=3)
    cut = [dict(m, truncated=True) if i in (2, 6) else dict(m) for i, m in enumerate(msgs)]   # replies 1 and 3
    rec = {'messages': [dict(m, score=1) for m in cut]}                         # an unknown key: ignored
    ds = ChatDataset.from_jsonl(_write(tmp_path / 'd.jsonl', [rec, {'messages': msgs}]), tok)
    eot = END_OF_TURN.get(template, '<|im_end|>')
    replies = [m['content'] for m in msgs if m['role'] == 'assistant']
    assert _masked_runs(tok, ds[0]['input_ids'], ds[0]['loss_mask']) == [replies[0], replies[1] + eot, replies[2]]
    assert _masked_runs(tok, ds[1]['input_ids'], ds[1]['loss_mask']) == [r + eot for r in replies]
    assert torch.equal(ds[0]['input_ids'], ds[1]['input_ids'])                 # the same rendering, another mask


def test_template_that_rerenders_earlier_turns_renders_once(chat_bpe, chat_tokenizers):
    "Earlier replies rendered differently once later turns follow (as Qwen3 drops reasoning): masked as rendered."
    from conftest import make_chat_tokenizer
    tok = make_chat_tokenizer(chat_bpe, 'chatml')
    tok.chat_template = tok.chat_template.replace(
        "{{ m['content'] }}", "{{ 'earlier' if m['role'] == 'assistant' and not loop.last else m['content'] }}")
    msgs = _conversation(np.random.default_rng(3), system=False, turns=2)
    ids, mask = tokenize_chat(tok, msgs, 'f.jsonl:4')
    assert _masked_runs(tok, ids, mask) == ['earlier<|im_end|>', msgs[-1]['content'] + '<|im_end|>']


def test_roles_any_case_and_unknown_role(tmp_path, chat_tokenizers):
    rec = {'conversations': [{'from': 'SYSTEM', 'value': 'be brief'}, {'from': 'Human', 'value': 'the cat'},
                             {'from': 'GPT', 'value': 'the dog runs'}]}
    assert [m['role'] for m in to_messages(rec)] == ['system', 'user', 'assistant']
    f = _write(tmp_path / 'd.jsonl', [rec, {'messages': [{'role': 'bot', 'content': 'x'}]}])
    with pytest.raises(DataError, match=r"d\.jsonl:2: messages\[0\]: role 'bot' is not one of "
                                        r"human, user, gpt, assistant, system, tool \(any case\)"):
        ChatDataset.from_jsonl(f, chat_tokenizers['chatml'])


def test_counts_table_and_no_usable_sample(tmp_path, chat_tokenizers):
    tok = chat_tokenizers['chatml']
    good = {'messages': [{'role': 'user', 'content': 'yes'}, {'role': 'assistant', 'content': 'no because the cat'}]}
    none = {'messages': [{'role': 'user', 'content': 'yes'}]}
    ds = ChatDataset.from_jsonl(_write(tmp_path / 'd.jsonl', [good, none, '{', good]), tok, skip_bad_lines=True)
    table = ds.stats.table()
    for row in ('read', 'used', 'skipped: no assistant reply', 'skipped: malformed line', 'truncated to max_length'):
        assert row in table
    assert [l.split()[-1] for l in table.splitlines()[1:3]] == ['4', '2']
    with pytest.raises(DataError, match=r"u\.jsonl: no usable sample among 2 records: 2 no assistant reply "
                                        r"\(first: .*u\.jsonl:1: no assistant turn"):
        ChatDataset.from_jsonl(_write(tmp_path / 'u.jsonl', [none, none]), tok)


def test_truncation_and_skips_are_counted(tmp_path, chat_tokenizers):
    tok, rng = chat_tokenizers['chatml'], np.random.default_rng(4)
    long = _conversation(rng, turns=3)
    full = tokenize_conversation(tok, long)
    first = int(full['loss_mask'].nonzero()[0])
    lines = [{'messages': long},
             {'messages': [{'role': 'user', 'content': 'yes'}]},                                   # no assistant turn
             {'messages': [{'role': 'user', 'content': 'yes'}, {'role': 'assistant', 'content': ' '}]},  # empty one
             {'messages': [{'role': 'system', 'content': chat_sentence(rng, 40)}] + long[1:]}]       # anchor cut off
    ds = ChatDataset.from_jsonl(_write(tmp_path / 'd.jsonl', lines), tok, max_length=first + 5)
    st = ds.stats
    assert (len(ds), st.samples, st.no_supervised, st.no_anchor, st.truncated) == (1, 1, 2, 1, 2)
    n4 = len(tokenize_conversation(tok, lines[3]['messages'])['input_ids'])
    assert st.truncated_tokens == (len(full['input_ids']) - (first + 5)) + (n4 - (first + 5))
    assert len(ds[0]['input_ids']) == first + 5 and ds[0]['loss_mask'].sum() == 5
    assert any('d.jsonl:2: no assistant turn' in e for e in st.errors)
    assert any('d.jsonl:4: no two consecutive assistant tokens within max_length' in e for e in st.errors)
    assert json.dumps(st.as_dict())                                                   # loggable as is


def test_malformed_line_names_file_and_line(tmp_path, chat_tokenizers):
    good = {'messages': [{'role': 'user', 'content': 'yes'}, {'role': 'assistant', 'content': 'no because the cat'}]}
    f = _write(tmp_path / 'train.jsonl', [good, '', good, '{"messages": [', good])
    with pytest.raises(DataError, match=r'train\.jsonl:4: malformed JSON line'):
        ChatDataset.from_jsonl(f, chat_tokenizers['chatml'])
    ds = ChatDataset.from_jsonl(f, chat_tokenizers['chatml'], skip_bad_lines=True)
    assert (len(ds), ds.stats.bad_lines, ds.stats.lines) == (3, 1, 4)
    f.write_bytes(f.read_bytes() + b'{"messages": "\xff\xfe"}\n')              # invalid UTF-8 on line 6
    st = DataStats()
    assert len(list(read_jsonl(f, skip_bad_lines=True, stats=st))) == 3 and st.bad_lines == 2
    assert 'train.jsonl:6: malformed JSON line' in st.errors[1]


@pytest.mark.parametrize('record, message', [
    ({'text': 'hello'}, "d.jsonl:2: no 'messages' or 'conversations' key (found keys ['text'])"),
    ({'messages': [{'content': 'x'}]}, "d.jsonl:2: messages[0] has no 'role' key"),
    ({'messages': [{'role': 'user', 'content': 'x'}, {'role': 'assistant'}]},
     "d.jsonl:2: messages[1] has no 'content' key"),
    ({'conversations': [{'from': 'human'}]}, "d.jsonl:2: conversations[0] has no 'value' key"),
    ({'conversations': [{'value': 'x'}]}, "d.jsonl:2: conversations[0] has no 'from' key"),
    ({'conversations': [{'from': 'robot', 'value': 'x'}]}, "d.jsonl:2: conversations[0]: role 'robot' is not one of"),
    ({'messages': [{'role': 'user', 'content': ['x']}]}, "d.jsonl:2: messages[0].content must be a string"),
    ([1, 2], "d.jsonl:2: expected a JSON object, got list"),
])
def test_record_of_neither_shape_names_line_and_key(tmp_path, chat_tokenizers, record, message):
    good = {'messages': [{'role': 'user', 'content': 'yes'}, {'role': 'assistant', 'content': 'no because the cat'}]}
    f = _write(tmp_path / 'd.jsonl', [good, record])
    with pytest.raises(DataError) as e: ChatDataset.from_jsonl(f, chat_tokenizers['chatml'])
    assert message in str(e.value)
    ds = ChatDataset.from_jsonl(f, chat_tokenizers['chatml'], skip_bad_lines=True)
    assert (len(ds), ds.stats.bad_lines) == (1, 1) and message in ds.stats.errors[0]


def test_missing_data_file(tmp_path, chat_tokenizers):
    with pytest.raises(FileNotFoundError, match='nope.jsonl: no such data file'):
        ChatDataset.from_jsonl(tmp_path / 'nope.jsonl', chat_tokenizers['chatml'])


@pytest.mark.parametrize('name', ['qwen3', 'llama'])
def test_target_features_are_the_hidden_states_at_layer_ids(chat_targets, name):
    t = TargetFeatures(chat_targets[name], num_draft_layers=3)
    assert t.layer_ids == [1, 2, 3] and t.dtype == torch.float32 and t.tokenizer is not None
    ids = torch.randint(0, 400, (2, 12))
    hs = t.model(ids, output_hidden_states=True).hidden_states
    assert torch.equal(t(ids), torch.cat([hs[2], hs[3], hs[4]], -1))              # (N, S, 3·H)
    assert t.embed_weight.shape == t.lm_head_weight.shape == (448, 64)
    assert not any(p.requires_grad for p in t.model.parameters())
    cfg = t.drafter_config(block_size=4)
    assert (cfg.target_layer_ids, cfg.num_hidden_layers, cfg.context_size, cfg.vocab_size) == ([1, 2, 3], 3, 192, 448)
    assert cfg.mask_token_id == len(t.tokenizer)                                    # the first unused embedding row


def test_target_features_bad_directories(tmp_path, chat_targets, chat_tokenizers):
    from transformers import T5Config, LlamaConfig, LlamaForCausalLM
    with pytest.raises(FileNotFoundError, match="missing': no such path"): TargetFeatures(tmp_path / 'missing')
    (tmp_path / 'empty').mkdir()
    with pytest.raises(ValueError, match='empty: no config.json, not a transformers model directory'):
        TargetFeatures(tmp_path / 'empty')
    T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8, vocab_size=64).save_pretrained(tmp_path / 't5')
    with pytest.raises(ValueError, match="t5: model_type 't5' is not a causal LM"): TargetFeatures(tmp_path / 't5')
    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
    cfg.save_pretrained(tmp_path / 'noweights')
    with pytest.raises(ValueError, match='noweights: no weight files'): TargetFeatures(tmp_path / 'noweights')
    msg = r'layer ids \[6, 9\] out of range: the target has 6 layers, ids must be in \[0, 5\]'
    with pytest.raises(ValueError, match=msg):
        TargetFeatures(chat_targets['llama'], layer_ids=[1, 6, 9])
    small = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, vocab_size=300))
    small.save_pretrained(tmp_path / 'small')
    with pytest.raises(ValueError, match=r"the tokenizer has \d+ tokens but the target's embedding has only 300 rows"):
        TargetFeatures(tmp_path / 'small', layer_ids=[0], tokenizer=chat_tokenizers['chatml'])


def test_collate_pads_and_keeps_per_sample_blocks(tmp_path, chat_tokenizers):
    tok, rng = chat_tokenizers['chatml'], np.random.default_rng(5)
    convs = [{'messages': _conversation(rng, turns=1 + i)} for i in range(3)]
    ds = ChatDataset.from_jsonl(_write(tmp_path / 'd.jsonl', convs), tok)
    b = collate([ds[2], ds[0], ds[1]], pad_token_id=tok.pad_token_id)
    S = len(ds[2]['input_ids'])
    assert b['input_ids'].shape == b['loss_mask'].shape == b['attention_mask'].shape == (3, S)
    assert b['sample_ids'].tolist() == [2, 0, 1] and 'context' not in b
    L = len(ds[0]['input_ids'])
    assert (b['input_ids'][1, L:] == tok.pad_token_id).all() and not b['loss_mask'][1, L:].any()
    assert b['attention_mask'].sum(1).tolist() == [S, L, len(ds[1]['input_ids'])]
    lay = BlockLayout.from_batch(b['input_ids'], b['loss_mask'], mask_token_id=0, block_size=4, num_anchors=5, seed=3,
                                 sample_ids=b['sample_ids'])
    alone = BlockLayout.from_batch(ds[0]['input_ids'][None], ds[0]['loss_mask'][None], mask_token_id=0, block_size=4,
                                   num_anchors=5, seed=3, sample_ids=[0])
    assert torch.equal(lay.anchors[1][lay.keep[1]], alone.anchors[0])


def test_online_features_feed_the_drafter(chat_targets, tmp_path):
    "End to end: JSONL -> batch -> target features -> layout -> drafter, sizes all agreeing."
    from dflash.model.drafter import DFlashDrafter
    t = TargetFeatures(chat_targets['qwen3'], num_draft_layers=2)
    rng = np.random.default_rng(7)
    convs = [{'messages': _conversation(rng)} for _ in range(2)]
    ds = ChatDataset.from_jsonl(_write(tmp_path / 'd.jsonl', convs), t.tokenizer)
    b = collate([ds[0], ds[1]], pad_token_id=t.tokenizer.pad_token_id)
    cfg = t.drafter_config(block_size=4)
    lay = BlockLayout.from_batch(b['input_ids'], b['loss_mask'], mask_token_id=cfg.mask_token_id,
                                 block_size=cfg.block_size, num_anchors=4, sample_ids=b['sample_ids'])
    ctx = t(b['input_ids'], b['attention_mask'])                                   # (2, S, 2·64)
    with torch.no_grad(): h = DFlashDrafter(cfg)(ctx, lay, t.embed_weight)
    assert ctx.shape[-1] == cfg.context_size and torch.isfinite(h).all()


TOY = Path(dflash.__file__).resolve().parent / 'assets' / 'toy-target'


@pytest.mark.skipif(not (TOY / 'config.json').is_file(), reason='the toy target is not built')
def test_shipped_toy_target(tmp_path):
    from dflash.data.cache import CacheDataset, write_cache
    t = TargetFeatures(TOY, num_draft_layers=1)
    rng = np.random.default_rng(8)
    convs = [_conversation(rng, system=False, turns=2) for _ in range(2)]
    ds = ChatDataset.from_jsonl(_write(tmp_path / 'd.jsonl', [{'messages': c} for c in convs]), t.tokenizer)
    assert len(ds) == 2
    for s, c in zip(ds, convs):
        runs = _masked_runs(t.tokenizer, s['input_ids'], s['loss_mask'])
        answers = [m['content'] for m in c if m['role'] == 'assistant']
        assert len(runs) == len(answers) and all(r.startswith(a) for r, a in zip(runs, answers))
    ctx = t(ds[0]['input_ids'][None])
    assert ctx.shape == (1, len(ds[0]['input_ids']), t.config.hidden_size)
    write_cache(t, ds, tmp_path / 'cache', progress=False)
    assert torch.equal(CacheDataset(tmp_path / 'cache', t)[0]['context'], ctx[0])
    assert t.drafter_config(block_size=4).context_size == t.config.hidden_size


def test_tokenize_command(tmp_path, chat_targets, capsys, monkeypatch):
    "`python -m dflash.data tokenize`: counts table, cached result; a dataset with nothing usable fails, naming it."
    from dflash.data.command import main
    monkeypatch.setenv('HF_DATASETS_CACHE', str(tmp_path / 'hf'))
    good = {'messages': [{'role': 'user', 'content': 'yes'}, {'role': 'assistant', 'content': 'no because the cat'}]}
    f = _write(tmp_path / 'd.jsonl', [good, {'messages': [{'role': 'user', 'content': 'x'}]}, good])
    main(['tokenize', '--target', str(chat_targets['qwen3']), '--data', str(f)])
    out, err = capsys.readouterr()
    assert 'tokenized: 2 samples' in out and 'skipped: no assistant reply' in err
    assert len(list((tmp_path / 'hf' / 'dflash-tokenized').iterdir())) == 1
    bad = _write(tmp_path / 'bad.jsonl', [{'messages': [{'role': 'user', 'content': 'x'}]}])
    with pytest.raises(SystemExit) as e: main(['tokenize', '--target', str(chat_targets['qwen3']), '--data', str(bad)])
    assert e.value.code == 2 and 'bad.jsonl: no usable sample among 1 records' in capsys.readouterr().err
