"""Chat fine-tuning (`finetune_chat`): conversations rendered in the model's own template
token for token as transformers renders them, the assistant's tokens (and only those)
scored as transformers' generation blocks mark them, bad lines named, packing that keeps
conversations apart, and a run that learns its answers and exports."""

import json
import os

import pytest

import models
from models.chat import ChatTemplate
from models.tokenizer import load_tokenizer
from tests.train_helpers import tiny_train_config
from train import data as data_lib
from train.data.pipeline.tokens import chat_start_id
from train.trainer import train_and_evaluate

transformers = pytest.importorskip("transformers")

# ChatML with the assistant's part in a generation block, so transformers marks it too.
CHATML = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Llama 3's shape: a start token, headers, and an end of turn after each message.
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
    "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
WORDS = "what is the capital of france paris spain madrid hello there how are you fine".split()
CONVERSATION = [{"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": "what is the capital of france"},
                {"role": "assistant", "content": "paris"},
                {"role": "user", "content": "and of spain"},
                {"role": "assistant", "content": "madrid, of course"}]


def _tokenizer_dir(root, template: str) -> str:
    from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers, trainers
    backend = Tokenizer(tok_models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    lines = [" ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(6)) for i in range(100)]
    backend.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=300, special_tokens=[*SPECIALS, "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|endoftext|>",
        unk_token="<unk>")
    tok.chat_template = template
    tok.save_pretrained(root)
    return str(root)


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory):
    return _tokenizer_dir(tmp_path_factory.mktemp("chatml"), CHATML)


@pytest.mark.parametrize("name", ["chatml", "llama3"])
def test_conversations_are_transformers_tokens_and_the_assistants_are_its_generation(
        tmp_path, name):
    path = _tokenizer_dir(tmp_path, CHATML if name == "chatml" else LLAMA3)
    hf = transformers.AutoTokenizer.from_pretrained(path)
    ours, template = load_tokenizer(path), ChatTemplate.from_directory(path)
    ids, flags = template.encode(ours, CONVERSATION)
    want = hf.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=name == "chatml")
    assert ids == list(want["input_ids"])
    assert template.render(CONVERSATION[:2], add_generation_prompt=True) == \
        hf.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True)
    if name == "chatml":
        assert flags == list(want["assistant_masks"])
    scored = hf.decode([i for i, f in zip(ids, flags, strict=True) if f])
    assert scored == ("paris<|im_end|>\nmadrid, of course<|im_end|>\n" if name == "chatml"
                      else "paris<|eot_id|>madrid, of course<|eot_id|>")
    assert chat_start_id(template, ours) == ids[0]


def test_a_conversation_the_template_cannot_split_is_refused(chatml_dir):
    # A template that writes a running count into every turn renders earlier turns anew.
    counting = ChatTemplate(
        "{% for m in messages %}[{{ messages | length }}]{{ m['content'] }}{% endfor %}")
    with pytest.raises(ValueError, match="conversation 7: the chat template renders "
                                         "message 3 differently"):
        counting.encode(load_tokenizer(chatml_dir), CONVERSATION, where="conversation 7")
    with pytest.raises(ValueError, match="no assistant message"):
        ChatTemplate(CHATML).encode(load_tokenizer(chatml_dir), CONVERSATION[:2])


def _chats_file(path, n=60, bad=True):
    """Conversations that ask to repeat two words (each pair once), with bad lines."""
    pairs = [(a, b) for a in WORDS for b in WORDS if a != b][:n]
    lines = [json.dumps({"messages": [
        {"role": "user", "content": f"say {a} {b}"},
        {"role": "assistant", "content": f"{a} {b}"}]}) for a, b in pairs]
    if bad:
        lines[2:2] = ["[1, 2", json.dumps({"messages": []}),
                      json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
                      json.dumps({"messages": [{"role": "robot", "content": "hi"}]})]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_batches_score_the_assistants_tokens_and_keep_conversations_apart(
        chatml_dir, tmp_path, data_dir):
    files = (_chats_file(tmp_path / "chats.jsonl"),)
    ds = data_lib.load_dataset("local_chat", data_dir, data_files=files)
    assert ds.kind == "chat" and ds.bad_lines.total == 4
    assert ds.bad_lines.examples == [
        f"{files[0]}:3: not JSON", f"{files[0]}:4: no 'messages' list",
        f"{files[0]}:5: no assistant message",
        f"{files[0]}:6: a message whose role is not one of "
        "['system', 'user', 'assistant', 'tool']"]
    tok, template = load_tokenizer(chatml_dir), ChatTemplate.from_directory(chatml_dir)
    cfg = data_lib.PipelineConfig(per_device_batch_size=2, max_target_length=96,
                                  chat_template=template)
    source, _ = data_lib.train_source(ds, tok, cfg, num_devices=1, shard_index=0,
                                      shard_count=1)
    start = chat_start_id(template, tok)
    for batch in (source[i] for i in range(3)):
        tokens, seg = batch["targets"][0], batch["targets_segmentation"][0]
        weights = batch["targets_weights"][0]
        assert seg.max() >= 2                                   # packed
        for row in range(tokens.shape[0]):
            for k in range(1, int(seg[row].max()) + 1):
                part = tokens[row][seg[row] == k]
                scored = tok.hf.decode(part[weights[row][seg[row] == k] > 0])
                # The conversation, from after its start id, then EOS (not scored).
                text = tok.hf.decode([start, *part])
                assert text.startswith("<|im_start|>user\nsay ")
                assert text.endswith("<|im_end|>\n<|endoftext|>")
                answer = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
                assert scored == f"{answer}<|im_end|>\n"
                assert text.split("\n")[1].startswith(f"say {answer}<|im_end|>")
        assert not weights[seg == 0].any()
    with pytest.raises(ValueError, match="holds conversations: it needs the model's chat "
                                         "template"):
        data_lib.train_source(ds, tok, data_lib.PipelineConfig(per_device_batch_size=2),
                              num_devices=1, shard_index=0, shard_count=1)


@pytest.mark.slow
def test_a_chat_run_learns_its_answers_and_the_export_answers_in_the_template(
        chatml_dir, tmp_path, data_dir, capsys):
    import torch

    import decode.__main__ as decode_cli
    model_dir = tmp_path / "model"
    for name in os.listdir(chatml_dir):
        (model_dir / name).parent.mkdir(exist_ok=True)
        (model_dir / name).write_bytes(open(os.path.join(chatml_dir, name), "rb").read())
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=len(hf_tok), n_positions=64, n_embd=32, n_layer=2, n_head=2,
        bos_token_id=hf_tok.bos_token_id, eos_token_id=hf_tok.eos_token_id)
    ).save_pretrained(model_dir)
    chats = _chats_file(tmp_path / "chats.jsonl", n=200, bad=False)
    config = tiny_train_config(data_dir, init_from=str(model_dir), dataset="local_chat",
                               data_files=chats, num_train_steps=200, learning_rate=3e-3,
                               lr_decay="constant", warmup_steps=1, label_smoothing=0.0,
                               max_source_length=48, max_target_length=48,
                               max_decode_length=16, per_device_batch_size=4,
                               eval_per_device_batch_size=8, checkpoint_every_steps=1000,
                               eval_every_steps=100)
    config.model_overrides = type(config.model_overrides)()
    zero = train_and_evaluate({**config.to_dict(), "num_train_steps": 0}, str(tmp_path / "z"))
    summary = train_and_evaluate(config, str(tmp_path / "chat"))
    assert summary["validation"]["loss"] < zero["validation"]["loss"] - 1.0
    # Only the answers and their end of turn are scored: a handful of tokens a conversation.
    assert summary["validation"]["tokens"] <= 4 * 25
    pre = models.load(summary["model"])
    assert ChatTemplate.from_directory(summary["model"]) == ChatTemplate.from_directory(
        str(model_dir))
    capsys.readouterr()
    assert decode_cli.main(["--model", summary["model"], "--chat", "--max-new-tokens", "8",
                            "say paris madrid", "say how spain"]) == 0
    # Answers as the assistant, in two words, the second one repeated (the tiny model's
    # first words are near misses): the prompt ended with the generation prompt, and the
    # answer stopped at the template's end of turn, none of the template's text in it.
    out = capsys.readouterr().out.split("\n")
    assert len(out) == 3 and out[2] == "", out
    for line, asked in zip(out[:2], ("madrid", "spain"), strict=True):
        assert line.split()[1:] == [asked], out
    assert decode_cli.main(["--model", summary["model"], "--chat", "--audio", "a.wav"]) == 2
    assert "--chat renders text for a generative model; --audio" in capsys.readouterr().err
    assert pre.model_type == "gpt2" and pre.tokenizer is not None
