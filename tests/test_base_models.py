"Base models (no chat template) and completion data (text records), and `--chat-template FILE` in every command."
import json
import numpy as np
import pytest, torch
from conftest import CHATML, SMALL, chat_sentence, make_chat_tokenizer, override, refused
from dflash.core.files import toy_target_dir, assets_dir
from dflash.data.templates import no_template_message
from dflash.data.command import main as data_main
from dflash.train.command import main as train_main
from dflash.decoding.speculate import main as speculate_main


def _write(path, records):
    path.write_text(''.join(json.dumps(r) + '\n' for r in records))
    return path


@pytest.fixture(scope='module')
def base(tmp_path_factory, chat_bpe):
    "A randomly initialised small causal LM saved with a tokenizer that has no chat template: a base model."
    from transformers import Qwen3Config, Qwen3ForCausalLM
    d = tmp_path_factory.mktemp('base') / 'base'
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, vocab_size=448,
                                 max_position_embeddings=4096)).save_pretrained(d)
    tok = make_chat_tokenizer(chat_bpe, 'chatml')
    tok.chat_template = None
    tok.save_pretrained(d)
    assert not (d / 'chat_template.jinja').exists()
    return d


@pytest.fixture(scope='module')
def files(tmp_path_factory):
    "text.jsonl (text records), chat.jsonl (messages records) and chatml.jinja (a template file)."
    d, rng = tmp_path_factory.mktemp('data'), np.random.default_rng(1)
    text = _write(d / 'text.jsonl', [{'text': '. '.join(chat_sentence(rng) for _ in range(4))} for _ in range(12)])
    chat = _write(d / 'chat.jsonl', [{'messages': [{'role': 'user', 'content': chat_sentence(rng)},
                                                   {'role': 'assistant', 'content': chat_sentence(rng)}]}
                                     for _ in range(12)])
    (d / 'chatml.jinja').write_text(CHATML)
    return {'text': text, 'chat': chat, 'template': d / 'chatml.jinja', 'dir': d}


@pytest.fixture(scope='module')
def trained(tmp_path_factory, base, files):
    "A drafter trained on the base model with text records, 2 steps (and τ measured on text prompts before and after)."
    out = tmp_path_factory.mktemp('run') / 'run'
    argv = ['--target', base, '--data', files['text'], '--eval-data', files['text'], '--out', out,
            *override(SMALL, '--spec-eval-prompts', '2'), '--spec-new-tokens', '8', '--max-steps', '2']
    summary = train_main(list(map(str, argv)))
    return out, summary


def test_a_base_model_trains_on_text_records(trained):
    out, summary = trained
    assert json.loads((out / 'run.json').read_text())['status'] == 'finished'
    assert (out / 'drafter' / 'model.safetensors').is_file()
    assert summary['spec_after']['prompts'] == 2                       # text prompts: no chat template needed


def test_speculate_on_text_records_gives_greedys_tokens(trained, base, files, capsys):
    out, _ = trained
    r = speculate_main(['--target', str(base), '--drafter', str(out / 'drafter'), '--data', str(files['text']),
                        '--num-prompts', '3', '--max-new-tokens', '12', '--temperature', '0', '--threads', '1',
                        '--no-progress'])
    said = capsys.readouterr().out
    assert r['prompts'] == 3 and r['runs'][0]['same_output'] == 3, r
    assert r['prompt_kind'].startswith('text: the first half of its tokens, at most 256'), r['prompt_kind']
    assert "text records: the first half of each text's tokens, at most 256" in said


def test_speculate_help_says_how_text_prompts_are_cut(capsys):
    with pytest.raises(SystemExit): speculate_main(['--help'])
    words = ' '.join(capsys.readouterr().out.split())
    assert 'the first half of the tokens of its text, at most 256' in words and '--chat-template' in words


def test_chat_data_on_a_base_model_names_the_remedies(base, files, tmp_path, capsys):
    err = refused(capsys, train_main, ['--target', str(base), '--data', str(files['chat']), '--out',
                                       str(tmp_path / 'run'), *SMALL, '--max-steps', '1'],
                  'its tokenizer has no chat template', 'pass --chat-template FILE', 'text records')
    assert str(base / 'chat_template.jinja') in err
    refused(capsys, speculate_main, ['--target', str(base), '--drafter', str(assets_dir() / 'toy-drafter'), '--data',
                                     str(files['chat']), '--temperature', '0'], 'pass --chat-template FILE')


def test_a_gguf_targets_message_names_no_path_inside_it(tmp_path):
    said = no_template_message(tmp_path / 'model.gguf')
    assert 'model.gguf/' not in said and 'chat_template.jinja' not in said
    assert '--chat-template FILE' in said and 'text records' in said


def test_chat_template_file_trains_a_base_model_and_is_recorded(base, files, tmp_path, capsys):
    run = tmp_path / 'run'
    argv = ['--target', str(base), '--data', str(files['chat']), '--chat-template', str(files['template']),
            '--out', str(run), *SMALL, '--max-steps', '1']
    train_main(argv)
    rec = json.loads((run / 'run.json').read_text())
    assert rec['status'] == 'finished' and rec['data']['chat_template']['path'] == str(files['template'])
    other = tmp_path / 'other.jinja'
    other.write_text(CHATML + '{# another #}')
    changed = files['dir'] / 'changed.jinja'
    changed.write_text(CHATML)
    run2 = tmp_path / 'run2'
    train_main([*override(argv, '--chat-template', str(changed), '--out', str(run2))])
    changed.write_text(CHATML + '{# edited #}')                        # the template changed since the run started
    refused(capsys, train_main, ['--out', str(run2), '--resume', '--max-steps', '2'],
            '--chat-template', 'changed since the run started')


def test_chat_template_file_overrides_the_toys_in_train_and_speculate(files, tmp_path):
    toy_template = tmp_path / 'toy.jinja'
    toy_template.write_text((toy_target_dir() / 'chat_template.jinja').read_text().replace('\n<|im_start|>', '<|im_start|>'))
    run = tmp_path / 'run'
    train_main(['--target', str(toy_target_dir()), '--data', str(files['chat']), '--chat-template', str(toy_template),
                '--out', str(run), *SMALL, '--max-steps', '1'])
    assert json.loads((run / 'run.json').read_text())['config']['chat_template'] == str(toy_template)
    r = speculate_main(['--target', str(toy_target_dir()), '--drafter', str(assets_dir() / 'toy-drafter'),
                        '--data', str(files['chat']), '--chat-template', str(toy_template), '--num-prompts', '2',
                        '--max-new-tokens', '8', '--temperature', '0', '--threads', '1', '--no-progress'])
    assert r['prompts'] == 2 and r['runs'][0]['same_output'] == 2 and r['prompt_kind'] == 'chat'


def test_speculate_on_a_base_model_with_a_template_file(trained, base, files):
    out, _ = trained
    r = speculate_main(['--target', str(base), '--drafter', str(out / 'drafter'), '--data', str(files['chat']),
                        '--chat-template', str(files['template']), '--num-prompts', '2', '--max-new-tokens', '8',
                        '--temperature', '0', '--threads', '1', '--no-progress'])
    assert r['prompts'] == 2 and r['runs'][0]['same_output'] == 2


def test_the_cache_fingerprint_changes_with_the_template(base, files, tmp_path, capsys):
    from dflash.data.chat import load_chat_data
    from dflash.data.templates import load_tokenizer
    other = tmp_path / 'other.jinja'
    other.write_text(CHATML + "{# the same rendering, another template #}")
    for t in (files['template'], other):
        load_chat_data(files['chat'], load_tokenizer(base, chat_template=t), cache_dir=tmp_path / 'tok')
    assert len(list((tmp_path / 'tok' / 'dflash-tokenized').iterdir())) == 2
    args = ['cache', '--target', str(base), '--data', str(files['chat']), '--out', str(tmp_path / 'c'),
            '--no-progress', '--chat-template']
    data_main([*args, str(files['template'])])
    manifest = json.loads((tmp_path / 'c' / 'manifest.json').read_text())
    assert manifest['data']['chat_template'] is not None
    refused(capsys, data_main, [*args, str(other)], 'rendered with chat template')


def test_tokenize_counts_text_records_and_refuses_mixed_data(base, files, tmp_path, capsys):
    data_main(['tokenize', '--target', str(base), '--data', str(files['text'])])
    err = capsys.readouterr().err
    assert 'used: text records, every token supervised' in err and '12' in err
    mixed = tmp_path / 'mixed.jsonl'
    mixed.write_text(files['text'].read_text() + files['chat'].read_text())
    refused(capsys, data_main, ['tokenize', '--target', str(toy_target_dir()), '--data', str(mixed)],
            'mixed.jsonl:13: a chat record among text records (the first at')
    refused(capsys, data_main, ['tokenize', '--target', str(base), '--data', str(files['chat'])],
            'pass --chat-template FILE')


@pytest.mark.parametrize('fmt', ['json', 'parquet', 'saved'])
def test_text_records_from_every_file_kind(base, files, tmp_path, fmt):
    import datasets
    from dflash.data.chat import load_chat_data
    from dflash.data.templates import load_tokenizer
    recs = [json.loads(line) for line in files['text'].read_text().splitlines()]
    path = tmp_path / ('saved' if fmt == 'saved' else f'text.{fmt}')
    if fmt == 'json': path.write_text(json.dumps(recs))
    elif fmt == 'parquet': datasets.Dataset.from_list(recs).to_parquet(str(path))
    else: datasets.Dataset.from_list(recs).save_to_disk(str(path))
    ds = load_chat_data(path, load_tokenizer(base), cache_dir=tmp_path / 'tok')
    assert (len(ds), ds.stats.text_records) == (12, 12) and ds.stats.supervised_tokens == ds.stats.tokens
