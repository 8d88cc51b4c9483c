"""Inputs that ended in a Python traceback, or in a misleading message, and now end in one named `error:` line with
exit status 2 (or, for a plan too large for any GPU, its "does not fit" answer): configs `dflash.plan` cannot plan for
and sizes past the target's reach, a target or drafter that does not fit `dflash.speculate`, a toy build or
regeneration with nowhere to write or nothing built, tool calls a chat template drops or refuses, a damaged Arrow file,
a data file without records, and a missing data file taken for a hub id."""
import json, os, shutil, subprocess, sys
from dataclasses import replace
import pytest
from dflash.model.config import DrafterConfig
from dflash.model.drafter import DFlashDrafter
from dflash.core.files import assets_dir, toy_data_dir, toy_target_dir
from dflash.plan import main as plan_main
from dflash.decoding.speculate import main as speculate_main
from dflash.data.command import main as data_main
from conftest import CHATML_GENERATION, refused, train_cli, tree


# --- dflash.plan ------------------------------------------------------------------------------------------------------
NOT_CAUSAL = {   # published configs of encoder and encoder-decoder models, their fields as the hub has them
    'bert': ({'architectures': ['BertForMaskedLM'], 'model_type': 'bert', 'hidden_size': 768, 'num_attention_heads': 12,
              'num_hidden_layers': 12, 'intermediate_size': 3072, 'vocab_size': 30522, 'max_position_embeddings': 512,
              'type_vocab_size': 2, 'hidden_act': 'gelu', 'layer_norm_eps': 1e-12},
             "model_type 'bert' is an encoder"),
    't5': ({'architectures': ['T5ForConditionalGeneration'], 'model_type': 't5', 'd_model': 512, 'd_ff': 2048,
            'd_kv': 64, 'num_heads': 8, 'num_layers': 6, 'vocab_size': 32128, 'is_encoder_decoder': True,
            'relative_attention_num_buckets': 32, 'feed_forward_proj': 'relu'},
           "model_type 't5' is not a causal LM")}


@pytest.mark.parametrize('kind', list(NOT_CAUSAL))
def test_plan_refuses_a_model_that_is_not_a_decoder_only_causal_lm(tmp_path, capsys, kind):
    config, why = NOT_CAUSAL[kind]
    (tmp_path / 'config.json').write_text(json.dumps(config))
    refused(capsys, plan_main, ['--target-config', str(tmp_path / 'config.json')],
            f"--target-config {tmp_path / 'config.json'}: {why}", "DFlash drafts for decoder-only causal LMs")


def test_plan_refuses_a_sequence_longer_than_the_target_reads(capsys):
    "Ten million tokens would hold real tensors of that length and take minutes per policy: past the target's reach."
    refused(capsys, plan_main, ['--target-config', 'qwen3-8b', '--seq-len', '100000000'],
            "--seq-len = 100000000: more tokens than the target's 40960 positions (max_position_embeddings)")


def test_plan_refuses_more_drafter_layers_than_the_target_has(tmp_path, capsys):
    "The drafter reads one target layer per layer: a GPT-2 config (12 layers, no GQA fields) and --layers 13."
    config = {'architectures': ['GPT2LMHeadModel'], 'model_type': 'gpt2', 'n_embd': 768, 'n_head': 12, 'n_layer': 12,
              'n_positions': 1024, 'n_inner': None, 'vocab_size': 50257, 'layer_norm_epsilon': 1e-05}
    (tmp_path / 'config.json').write_text(json.dumps(config))
    refused(capsys, plan_main, ['--target-config', str(tmp_path / 'config.json'), '--seq-len', '1024',
                                '--layers', '13'],
            "--layers = 13: allowed 1..12 (the drafter reads one target layer each; the target has 12)")


def test_plan_of_a_million_wide_target_answers_does_not_fit(tmp_path, capsys):
    "Its weights alone fill no GPU: the table, planned at a budget that holds them, and exit 3 (does not fit)."
    config = {'architectures': ['Qwen3ForCausalLM'], 'model_type': 'qwen3', 'hidden_size': 1_000_000,
              'intermediate_size': 1024, 'num_hidden_layers': 6, 'num_attention_heads': 4, 'num_key_value_heads': 2,
              'head_dim': 64, 'vocab_size': 1024, 'max_position_embeddings': 4096}
    (tmp_path / 'config.json').write_text(json.dumps(config))
    rc = plan_main(['--target-config', str(tmp_path / 'config.json'), '--seq-len', '256', '--anchors', '8',
                    '--policies', 'all'])
    out = capsys.readouterr()
    assert rc == 3, out
    assert 'does not fit: 80.00 GiB does not even hold the weights' in out.out and 'no policy fits' in out.out, out
    assert 'Traceback' not in out.err


# --- dflash.speculate -------------------------------------------------------------------------------------------------
def _no_eos_target(d):
    "A copy of the toy target whose tokenizer, config and generation config name no end-of-sequence token."
    shutil.copytree(toy_target_dir(), d)
    for name, key in (('tokenizer_config.json', 'eos_token'), ('config.json', 'eos_token_id'),
                      ('generation_config.json', 'eos_token_id')):
        conf = json.loads((d / name).read_text())
        del conf[key]
        (d / name).write_text(json.dumps(conf))
    return d


def _other_drafter(d, **sizes):
    "An untrained drafter like the toy's with other `sizes`."
    DFlashDrafter(replace(DrafterConfig.load(assets_dir() / 'toy-drafter' / 'config.json'), **sizes)).save_pretrained(d)
    return d


@pytest.mark.parametrize('kind', ['no-eos', 'hidden-size', 'vocab-size'])
def test_speculate_names_what_does_not_fit_before_decoding(tmp_path, capsys, kind):
    target, drafter = toy_target_dir(), assets_dir() / 'toy-drafter'
    if kind == 'no-eos':
        target = _no_eos_target(tmp_path / 'target')
        expect = [f"--target {target}: its tokenizer has no end-of-sequence token (eos_token)"]
    elif kind == 'hidden-size':
        drafter = _other_drafter(tmp_path / 'drafter', hidden_size=64, head_dim=16)
        expect = [f"--drafter: drafter {drafter} does not fit the target", "hidden_size 64 != target's 128"]
    else:
        drafter = _other_drafter(tmp_path / 'drafter', vocab_size=2048, mask_token_id=2047)
        expect = [f"--drafter: drafter {drafter} does not fit the target", "vocab_size 2048 != target's 1024"]
    refused(capsys, speculate_main, ['--target', str(target), '--drafter', str(drafter), '--data',
                                     str(toy_data_dir() / 'eval.jsonl'), '--num-prompts', '1', '--max-new-tokens', '4',
                                     '--temperature', '0', '--threads', '1', '--no-progress'], *expect)


# --- dflash.toy -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('where', ['under-a-file', 'read-only'])
def test_toy_build_refuses_an_out_it_cannot_write(tmp_path, where):
    "Exit 2 before the corpus is made, nothing written (the read-only case in a process without root's overrides)."
    (tmp_path / 'notes.txt').write_text('notes\n')
    (tmp_path / 'locked').mkdir(mode=0o555)
    out = tmp_path / ('notes.txt/toy' if where == 'under-a-file' else 'locked/toy')
    before = tree(tmp_path)
    r = train_cli('build', '--out', out, '--steps', '1', module='dflash.toy')
    assert r.returncode == 2, r.stderr
    why = 'Not a directory' if where == 'under-a-file' else 'Permission denied'
    assert f"--out = '{out}': cannot write there ({why}" in r.stderr and 'Traceback' not in r.stderr, r.stderr
    assert tree(tmp_path) == before and not out.exists()


def test_toy_regenerate_without_a_built_target_is_named(tmp_path):
    out = tmp_path / 'toy'
    r = train_cli('regenerate', '--out', out, module='dflash.toy')
    assert r.returncode == 2 and 'Traceback' not in r.stderr, r.stderr
    assert f"--out = '{out}': no toy target built there (no {out / 'toy-target' / 'config.json'})" in r.stderr
    assert f"python -m dflash.toy build --out {out}" in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_toy_commands_default_to_a_folder_here_not_the_installed_package(tmp_path):
    "No --out: `toy` in the current directory; the package's shipped toy is rewritten only where --out names it."
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}
    r = subprocess.run([sys.executable, '-m', 'dflash.toy', 'regenerate'], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "--out = 'toy': no toy target built there (no toy/toy-target/config.json)" in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []


# --- chat data --------------------------------------------------------------------------------------------------------
TOOL_CHAT = {'messages': [
    {'role': 'user', 'content': 'What is the weather in Paris?'},
    {'role': 'assistant', 'content': None,
     'tool_calls': [{'type': 'function', 'function': {'name': 'get_weather', 'arguments': {'city': 'Paris'}}}]},
    {'role': 'tool', 'content': '{"temp": 20}', 'name': 'get_weather'},
    {'role': 'assistant', 'content': 'It is 20 degrees in Paris.'}]}
GENERATION_TEMPLATES = {   # with {% generation %}: one writing tool calls, ChatML's that drops them, one refusing them
    'writes-tool-calls':
        "{%- for m in messages %}{%- if m.role == 'assistant' %}<|im_start|>assistant\n{% generation %}"
        "{% if m.content %}{{ m.content }}{% endif %}{% for tc in m.tool_calls or [] %}<tool_call>\n"
        "{{ tc.function | tojson }}\n</tool_call>{% endfor %}<|im_end|>{% endgeneration %}\n"
        "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
        "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{%- endfor %}",
    'drops-tool-calls': CHATML_GENERATION,
    'refuses-the-tool-role':
        "{% for m in messages %}{% if m.role not in ['user', 'assistant', 'system'] %}"
        "{{ raise_exception('Only user, assistant and system roles are supported') }}{% endif %}"
        "<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>"
        "{% endgeneration %}{% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}"}


@pytest.mark.parametrize('template', list(GENERATION_TEMPLATES))
def test_tool_calls_under_a_generation_template(tmp_path, capsys, monkeypatch, template):
    """A template that writes tool calls supervises the call and the reply (this already held: it guards the
    `{% generation %}` path with tool calls); one that drops the call or refuses the tool turn names the record."""
    monkeypatch.setenv('HF_DATASETS_CACHE', str(tmp_path / 'hf'))
    (tmp_path / 'chat.jinja').write_text(GENERATION_TEMPLATES[template])
    data = tmp_path / 'tools.jsonl'
    data.write_text(json.dumps(TOOL_CHAT) + '\n')
    argv = ['tokenize', '--target', str(toy_target_dir()), '--data', str(data), '--chat-template',
            str(tmp_path / 'chat.jinja')]
    if template == 'writes-tool-calls':
        from dflash.data.chat import load_chat_data
        from dflash.data.templates import load_tokenizer
        tok = load_tokenizer(toy_target_dir(), chat_template=tmp_path / 'chat.jinja')
        s = load_chat_data(data, tok, cache_dir=tmp_path / 'hf')[0]
        assert tok.decode(s['input_ids'][s['loss_mask']]) == ('<tool_call>\n{"name": "get_weather", "arguments": '
                                                              '{"city": "Paris"}}\n</tool_call><|im_end|>'
                                                              'It is 20 degrees in Paris.<|im_end|>')
        return
    why = ('the chat template does not write tool calls' if template == 'drops-tool-calls' else
           'the chat template rejects this conversation (Only user, assistant and system roles are supported)')
    refused(capsys, data_main, argv, f"{data}: no usable sample among 1 records: 1 the chat template rejects it "
                                     f"(first: {data}:1: {why}")


def _cut_arrow(d, lone: bool):
    "A dataset saved by `datasets` whose Arrow file lost its second half; `lone`: that Arrow file alone."
    import datasets
    recs = [json.loads(line) for line in (toy_data_dir() / 'train.jsonl').read_text().splitlines()[:40]]
    datasets.Dataset.from_list(recs).save_to_disk(str(d / 'saved'))
    arrow = next((d / 'saved').glob('*.arrow'))
    arrow.write_bytes(arrow.read_bytes()[:arrow.stat().st_size // 2])
    return arrow if lone else d / 'saved'


@pytest.mark.parametrize('lone', [False, True], ids=['saved-dataset', 'lone-arrow-file'])
def test_a_cut_arrow_file_is_named(tmp_path, capsys, monkeypatch, lone):
    monkeypatch.setenv('HF_DATASETS_CACHE', str(tmp_path / 'hf'))
    data = _cut_arrow(tmp_path, lone)
    expect = (f"{data}: an Arrow file alone, which dflash does not read" if lone else
              f"{data}: a dataset saved by `datasets` that does not load (")
    refused(capsys, data_main, ['tokenize', '--target', str(toy_target_dir()), '--data', str(data)], expect)


@pytest.mark.parametrize('suffix', ['.parquet', '.jsonl'])
def test_a_data_file_without_records_is_named(tmp_path, capsys, monkeypatch, suffix):
    "A parquet file of 0 rows and an empty JSONL file: 'no records', naming the file (the same words for both)."
    import pyarrow as pa, pyarrow.parquet as pq
    monkeypatch.setenv('HF_DATASETS_CACHE', str(tmp_path / 'hf'))
    data = tmp_path / f'empty{suffix}'
    if suffix == '.parquet': pq.write_table(pa.table({'messages': pa.array([], pa.string())}), data)
    else: data.write_text('')
    refused(capsys, data_main, ['tokenize', '--target', str(toy_target_dir()), '--data', str(data)],
            f"{data}: no usable sample among 0 records: no records")


@pytest.mark.parametrize('name', ['missing.jsonl', 'chats/missing.parquet'])
def test_a_missing_data_file_is_not_taken_for_a_hub_id(tmp_path, capsys, monkeypatch, name):
    "`owner/name` stays a hub id; a name ending in a data file's suffix is a file, and its absence is said as such."
    monkeypatch.chdir(tmp_path)
    err = refused(capsys, data_main, ['regenerate', '--target', str(toy_target_dir()), '--data', name, '--out',
                                str(tmp_path / 'out.jsonl')],
            f"--data: dataset '{name}': no such path ({tmp_path / name}): the file does not exist")
    assert 'Hugging Face cache' not in err and 'hf download' not in err, err
