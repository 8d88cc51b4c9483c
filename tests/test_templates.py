"Assistant masks on the official chat templates of Qwen3, Qwen2.5, Llama 3.3 and Mistral (Nemo, v0.3) (tests/fixtures/templates)."
import json, re
from pathlib import Path
import numpy as np
import pytest
from transformers import PreTrainedTokenizerFast
from dflash.data.chat import ChatDataset, tokenize_conversation
from dflash.data.templates import tokenize_chat

FIXTURES = Path(__file__).parent / 'fixtures' / 'templates'
CITY = {'type': 'object', 'properties': {'city': {'type': 'string'}}}
TOOLS = [{'type': 'function',
          'function': {'name': 'weather', 'description': 'the weather of a city', 'parameters': CITY}}]
CALL = {'name': 'weather', 'arguments': {'city': 'the house'}}


def template_tokenizer(bpe, name):
    "The test BPE with the special tokens (and non-special added tokens) the real tokenizer of `name` has."
    ends = {'qwen3': dict(eos_token='<|im_end|>', pad_token='<|endoftext|>'),
            'qwen2.5': dict(eos_token='<|im_end|>', pad_token='<|endoftext|>'),
            'llama3.3': dict(bos_token='<|begin_of_text|>', eos_token='<|eot_id|>'),
            'mistral-nemo': dict(bos_token='<s>', eos_token='</s>'),
            'mistral-v0.3': dict(bos_token='<s>', eos_token='</s>')}[name]
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, **ends)
    if name.startswith('qwen'):   # Qwen's tokenizers: these are added tokens, not special ones
        tok.add_tokens(['<think>', '</think>', '<tool_call>', '</tool_call>', '<tool_response>', '</tool_response>'])
    if name == 'llama3.3': tok.add_special_tokens({'additional_special_tokens': ['<|eom_id|>', '<|python_tag|>']})
    if name.startswith('mistral'):
        control = ['[INST]', '[/INST]', '[TOOL_CALLS]', '[AVAILABLE_TOOLS]', '[/AVAILABLE_TOOLS]', '[TOOL_RESULTS]',
                   '[/TOOL_RESULTS]']
        tok.add_special_tokens({'additional_special_tokens': control})
    tok.chat_template = (FIXTURES / f'{name}.jinja').read_text()
    return tok


TEMPLATES = ('qwen3', 'qwen2.5', 'llama3.3', 'mistral-nemo', 'mistral-v0.3')


@pytest.fixture(scope='module')
def toks(chat_bpe):
    return {n: template_tokenizer(chat_bpe, n) for n in TEMPLATES}


def masked_runs(tok, ids, mask):
    "The decoded text of each contiguous run of loss-masked tokens."
    m = mask.int().numpy()
    runs = np.split(np.arange(len(m)), np.flatnonzero(np.diff(m)) + 1)
    return [tok.decode(ids[r].tolist()) for r in runs if m[r[0]]]


def check(tok, msgs, want, tools=None, **kw):
    "Masked tokens decode to `want`, and the ids are those of the whole conversation as the template renders it."
    ids, mask = tokenize_chat(tok, msgs, tools=tools, **kw)
    assert masked_runs(tok, ids, mask) == want
    whole = tok.apply_chat_template(msgs, tools=tools, tokenize=True, return_dict=True, **kw)
    assert ids.tolist() == whole['input_ids']


def chat(*turns):
    return [{'role': r, 'content': c} for r, c in zip(('user', 'assistant') * len(turns), turns)]


def test_qwen3_strips_earlier_reasoning(toks):
    "Earlier replies lose their reasoning in the rendering; the last keeps it; each mask is the reply as rendered."
    msgs = [{'role': 'system', 'content': 'be brief'},
            {'role': 'user', 'content': 'the cat'},
            {'role': 'assistant', 'content': '<think>\nwhy the dog\n</think>\n\nthe dog runs'},
            {'role': 'user', 'content': 'and the tree'},
            {'role': 'assistant', 'content': 'the red tree', 'reasoning_content': 'because the tree'},
            {'role': 'user', 'content': 'the river'},
            {'role': 'assistant', 'content': 'a blue river', 'reasoning_content': 'the river runs'}]
    tok = toks['qwen3']
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert 'why the dog' not in text and 'because the tree' not in text      # stripped: no prefix rendering works
    check(tok, msgs, ['the dog runs<|im_end|>', 'the red tree<|im_end|>',
                      '<think>\nthe river runs\n</think>\n\na blue river<|im_end|>'])


def test_qwen3_thinking_off_keeps_the_empty_think_block_out(toks):
    "With enable_thinking=False the serving stack writes the empty think block (generation prompt): not supervised."
    msgs = chat('the cat', 'the dog', 'a tree', 'a red house')
    check(toks['qwen3'], msgs, ['the dog<|im_end|>', 'a red house<|im_end|>'], enable_thinking=False)
    check(toks['qwen3'], msgs, ['the dog<|im_end|>', '<think>\n\n</think>\n\na red house<|im_end|>'])


def test_qwen3_tool_turns_are_context(toks):
    msgs = [{'role': 'user', 'content': 'the weather of the house'},
            {'role': 'assistant', 'content': '', 'tool_calls': [{'type': 'function', 'function': CALL}]},
            {'role': 'tool', 'content': 'red and blue'},
            {'role': 'assistant', 'content': 'the house is red', 'reasoning_content': 'the tool says red'}]
    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "the house"}}\n</tool_call>'
    check(toks['qwen3'], msgs, [f'{call}<|im_end|>',
                                '<think>\nthe tool says red\n</think>\n\nthe house is red<|im_end|>'], tools=TOOLS)


def test_qwen25_tools_and_default_system(toks):
    msgs = [{'role': 'user', 'content': 'the weather of the house'},
            {'role': 'assistant', 'content': 'a call', 'tool_calls': [{'type': 'function', 'function': CALL}]},
            {'role': 'tool', 'content': 'red and blue'},
            {'role': 'assistant', 'content': 'the house is red'},
            {'role': 'user', 'content': 'and the tree'},
            {'role': 'assistant', 'content': 'green'}]
    call = '\n<tool_call>\n{"name": "weather", "arguments": {"city": "the house"}}\n</tool_call>'
    for tools in (TOOLS, None):
        check(toks['qwen2.5'], msgs, [f'a call{call}<|im_end|>', 'the house is red<|im_end|>', 'green<|im_end|>'],
              tools=tools)


def test_llama33_system_tools_and_trim(toks):
    msgs = [{'role': 'system', 'content': 'be brief'}, *chat('the cat', '  the dog runs \n', 'why', 'because')]
    check(toks['llama3.3'], msgs, ['the dog runs<|eot_id|>', 'because<|eot_id|>'])
    tool_msgs = [{'role': 'user', 'content': 'the weather of the house'},
                 {'role': 'assistant', 'tool_calls': [{'type': 'function', 'function': CALL}], 'content': None},
                 {'role': 'tool', 'content': 'red'},
                 {'role': 'assistant', 'content': 'the house is red'}]
    check(toks['llama3.3'], tool_msgs, ['{"name": "weather", "parameters": {"city": "the house"}}<|eot_id|>',
                                        'the house is red<|eot_id|>'], tools=TOOLS)


def test_mistral_without_generation_prompt(toks):
    "Mistral's template has no generation prompt and puts the system prompt into the last user turn."
    msgs = [{'role': 'system', 'content': 'the dog'}, *chat('the cat', 'the dog', 'a tree', 'the dog and the cat')]
    check(toks['mistral-nemo'], msgs, ['the dog</s>', 'the dog and the cat</s>'])


def test_mistral_v03_supervises_the_leading_space(toks):
    """Mistral v0.3 renders each reply as ' ' + reply + '</s>' after [/INST], and its prompt ends at [/INST]: the
    space is the target's first character. Replies starting with a digit make it a token of its own ('Ġ', '4', ...),
    which must be supervised like the rest: the masked tokens are exactly the rendered reply and its '</s>'."""
    tok = toks['mistral-v0.3']
    msgs = [{'role': 'system', 'content': 'be brief'}, *chat('the cat', '42 dogs run', 'why', '7 because')]
    ids, _ = tokenize_chat(tok, msgs)
    pieces = tok.convert_ids_to_tokens(ids.tolist())
    assert [pieces[i + 1] for i, t in enumerate(pieces) if t == '[/INST]'] == ['Ġ', 'Ġ']     # the spaces stand alone
    text = tok.apply_chat_template(msgs, tokenize=False)
    replies = [text[m.end():text.index('</s>', m.end()) + len('</s>')] for m in re.finditer(re.escape('[/INST]'), text)]
    assert replies == [' 42 dogs run</s>', ' 7 because</s>']
    check(tok, msgs, replies)


@pytest.mark.parametrize('name', TEMPLATES)
def test_many_random_conversations(toks, name):
    "Random multi-turn chats (replies that repeat the user's words included): each reply and its end of turn."
    from conftest import chat_sentence
    tok, rng = toks[name], np.random.default_rng(3)
    eot = {'qwen3': '<|im_end|>', 'qwen2.5': '<|im_end|>', 'llama3.3': '<|eot_id|>', 'mistral-nemo': '</s>',
           'mistral-v0.3': '</s>'}[name]
    for _ in range(20):
        turns = [chat_sentence(rng) for _ in range(2 * int(rng.integers(1, 4)))]
        turns[1] = turns[0]                                                   # a reply equal to its question
        msgs = chat(*turns)
        want = [(' ' if name == 'mistral-v0.3' else '') + t + eot for t in turns[1::2]]
        if name == 'qwen3': want[-1] = '<think>\n\n</think>\n\n' + want[-1]
        check(tok, msgs, want)


def long_chat(rng, name, turns, system):
    "A random conversation of `turns` exchanges; on Qwen3 every reply has reasoning (kept after the last user turn)."
    from conftest import chat_sentence
    msgs = [{'role': 'system', 'content': 'be brief'}] if system else []
    for _ in range(turns):
        reply = {'role': 'assistant', 'content': chat_sentence(rng, int(rng.integers(3, 40)))}
        if name == 'qwen3': reply['reasoning_content'] = chat_sentence(rng)
        msgs += [{'role': 'user', 'content': chat_sentence(rng, int(rng.integers(3, 40)))}, reply]
    return msgs


@pytest.mark.parametrize('name', TEMPLATES)
def test_long_conversation_keeps_what_the_whole_rendering_keeps(toks, name):
    """Conversations past max_length, rendered only as far as needed: ids and mask equal the whole rendering's first
    max_length, also where a template renders a turn by what follows it (Qwen3's reasoning, Mistral's system)."""
    tok, rng = toks[name], np.random.default_rng(11)
    for case in range(24):
        msgs = long_chat(rng, name, int(rng.integers(1, 30)), system=case % 2 == 0)
        max_length = int(rng.integers(8, 120))
        ids, mask = tokenize_chat(tok, msgs)
        s = tokenize_conversation(tok, msgs, max_length=max_length)
        if s is None:                                              # nothing supervised within max_length
            assert mask[:max_length].sum() < 2, (case, max_length)
            continue
        assert s['input_ids'].tolist() == ids[:max_length].tolist(), (case, max_length)
        assert s['loss_mask'].tolist() == mask[:max_length].tolist(), (case, max_length)


@pytest.mark.parametrize('name', TEMPLATES)
def test_a_100000_turn_conversation_renders_only_its_first_turns(toks, name, monkeypatch):
    "Time in proportion to what is kept: at max_length 128, no rendering of more than a few dozen messages."
    tok = toks[name]
    msgs = long_chat(np.random.default_rng(0), name, 50_000, system=True)
    rendered = []
    render = tok.apply_chat_template
    def counting(conversation, *a, **kw):
        rendered.append(len(conversation))
        return render(conversation, *a, **kw)
    monkeypatch.setattr(tok, 'apply_chat_template', counting)
    s = tokenize_conversation(tok, msgs, max_length=128)
    assert len(s['input_ids']) == 128 and s['loss_mask'].any()
    assert max(rendered) <= 64, sorted(set(rendered))


def test_template_that_rejects_a_conversation_is_counted(tmp_path, toks):
    "Mistral's template raises on roles out of order: that record is skipped and counted, with its line."
    f = tmp_path / 'd.jsonl'
    f.write_text(json.dumps({'messages': chat('the cat', 'the dog')}) + '\n' +
                 json.dumps({'messages': [{'role': 'assistant', 'content': 'the dog'}]}) + '\n')
    ds = ChatDataset.from_jsonl(f, toks['mistral-nemo'])
    assert (len(ds), ds.stats.template_rejected) == (1, 1) and 'd.jsonl:2' in ds.stats.errors[0]
