"""The quick start's character tokenizer and its transformers twin agree token for token."""
from mcore_rl.data.tokenizer import CharTokenizer, load_tokenizer
from mcore_rl.data.toy_task import toy_records, toy_tokenizer


def test_hf_twin_encodes_prompts_and_decodes_responses_like_the_char_tokenizer(tmp_path):
    ours = toy_tokenizer()
    ours.save(tmp_path)
    assert isinstance(load_tokenizer(tmp_path), CharTokenizer)
    hf = load_tokenizer(tmp_path).to_hf()
    prompts = [r.prompt for r in toy_records("train", 0, seed=0)]
    assert hf(text=prompts)["input_ids"] == [ours.encode_prompt(p, chat=False) for p in prompts]
    response = ours.encode("17") + [ours.eos_id, ours.pad_id]
    assert hf.decode(response, skip_special_tokens=True) == ours.decode(response) == "17"
    assert (hf.eos_token_id, hf.pad_token_id, hf.bos_token_id) == (ours.eos_id, ours.pad_id, ours.bos_id)


def test_hf_chat_prompt_is_the_rendered_template_as_plain_token_ids():
    from transformers import AutoTokenizer

    from mcore_rl.models.smollm2 import prepare_smollm2_hf_dir

    hf_dir = prepare_smollm2_hf_dir()
    ours = load_tokenizer(hf_dir)
    text = "What is 12 + 7?"
    ids = ours.encode_prompt(text, chat=True)
    hf = AutoTokenizer.from_pretrained(hf_dir)
    rendered = hf.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      tokenize=False)
    assert rendered.endswith("<|im_start|>assistant\n")
    assert all(type(i) is int for i in ids)
    assert ids == hf(rendered, add_special_tokens=False)["input_ids"]
    assert ours.encode_prompt(text, chat=False) == hf(text)["input_ids"]
