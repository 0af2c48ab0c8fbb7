"""Prompts with images through the engine on a tiny random Idefics3: greedy fp32 tokens equal transformers'
Idefics3ForConditionalGeneration.generate, rows of 1 and 3 images mixed with text-only rows in one batch, prefill in
chunks that start and end inside images; the prefix cache keys images by content; bad images fail their row alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from PIL import Image

from batchjob.engine.engine import Engine
from batchjob.engine.outputs import Request
from batchjob.engine.sampling_params import SamplingParams
from tests.vision.tiny_idefics3 import image, png_bytes

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def oracle(idefics3):
    folder, hf = idefics3
    return hf, transformers.AutoProcessor.from_pretrained(folder)


def hf_tokens(oracle, prompt: str | list[int], images: list[Image.Image]) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy output ids) of transformers: its processor for a prompt with images, the ids as given
    for a text-only one. An eos id outside the vocabulary never stops it (the engine ignores eos too)."""
    hf, processor = oracle
    if images:
        inputs = processor(text=[prompt], images=[images], return_tensors="pt")
    else:
        inputs = {"input_ids": torch.tensor([prompt]), "attention_mask": torch.ones(1, len(prompt), dtype=torch.long)}
    with torch.inference_mode():
        out = hf.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=10**6)
    n = inputs["input_ids"].shape[1]
    return inputs["input_ids"][0].tolist(), out[0, n:].tolist()


def vision_engine(folder, **config) -> Engine:
    return Engine(str(folder), **{"dtype": "float32", "device": "cpu", "num_kv_blocks": 512, **config})


@pytest.mark.parametrize("budget", [16, 2048], ids=["chunked", "whole"])
def test_mixed_batch_equals_transformers(idefics3, oracle, budget, tmp_path):
    folder, _ = idefics3
    wide, tall, small = image(0, (40, 24)), image(1, (20, 36)), image(2, (9, 13))
    path = tmp_path / "tall.png"
    tall.save(path)
    rows = [
        ("User: what is in <image>? Assistant:", [wide], [wide]),
        ("A text-only row about a fox.", [], []),
        ("<image> first, <image> second and <image> last.", [small, png_bytes(wide), str(path)], [small, wide, tall]),
        ("Another plain row.", [], []),
        ("Caption:<image>", [tall], [tall]),
    ]
    engine = vision_engine(folder, max_num_batched_tokens=budget, block_size=8)
    prompts = [{"prompt": text, "images": given} if given else text for text, given, _ in rows]
    outs = engine.generate(prompts, GREEDY, use_tqdm=False)
    for (text, _, decoded), out in zip(rows, outs):
        assert out.error is None, out.error
        ids, ref = hf_tokens(oracle, text if decoded else out.prompt_token_ids, decoded)
        assert out.prompt_token_ids == ids, text
        assert out.token_ids == ref, text


def test_prefix_cache_keys_images_by_content(idefics3, oracle):
    folder, _ = idefics3
    first, second = image(3, (40, 24)), image(4, (40, 24))  # the same size: the same placeholder tokens
    text = "A long shared system prompt that fills a few blocks before the picture. <image> What is it?"
    engine = vision_engine(folder, block_size=4)
    (warm,) = engine.generate([{"prompt": text, "images": [first]}], GREEDY, use_tqdm=False)
    # the same image first: a row that diverges after a cached prefix may take the cached block after it for its own
    same, other = engine.generate(
        [{"prompt": text, "images": [first]}, {"prompt": text, "images": [second]}], GREEDY, use_tqdm=False
    )
    assert other.prompt_token_ids == same.prompt_token_ids == warm.prompt_token_ids
    image_token = engine.runner.image_encoder.config.image_token_id
    positions = [i for i, t in enumerate(warm.prompt_token_ids) if t == image_token]
    # the other image reads only the text before it from the cache; the same image reads its own blocks too
    assert 0 < other.num_cached_tokens <= positions[0]
    assert same.num_cached_tokens > positions[-1]
    assert other.token_ids == hf_tokens(oracle, text, [second])[1]
    assert same.token_ids == warm.token_ids == hf_tokens(oracle, text, [first])[1]
    assert other.token_ids != same.token_ids


def test_samples_share_the_prompt_with_its_images(idefics3, oracle):
    """n samples fork after the prompt: the last, partial block (image tokens in it) is computed again by each."""
    folder, _ = idefics3
    img = image(5, (9, 13))
    engine = vision_engine(folder, block_size=64)
    (out,) = engine.generate(
        [{"prompt": "Look: <image>", "images": [img]}], SamplingParams(n=2, max_tokens=MAX_TOKENS, ignore_eos=True)
    )
    ref = hf_tokens(oracle, "Look: <image>", [img])[1]
    assert [s.token_ids for s in out.samples] == [ref, ref]


def test_preempted_rows_recompute_with_their_images(idefics3, oracle):
    """A pool too small for every row at once: rows preempted by recompute prefill their images again."""
    folder, _ = idefics3
    imgs = [image(10 + i, (40, 24)) for i in range(4)]
    text = "Row <image> here."
    engine = vision_engine(folder, num_kv_blocks=16, block_size=4, max_num_batched_tokens=16)  # 10 blocks a row
    outs = engine.generate([{"prompt": text, "images": [img]} for img in imgs], GREEDY, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    for img, out in zip(imgs, outs):
        assert out.token_ids == hf_tokens(oracle, text, [img])[1]


def test_bad_images_fail_their_row_alone(idefics3, tmp_path, monkeypatch):
    folder, _ = idefics3
    png = png_bytes(image(6, (40, 24)))
    engine = vision_engine(folder)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 960 pixels: over twice the limit, a decompression bomb
    prompts = [
        {"prompt": "a <image>", "images": [b"not an image"]},
        {"prompt": "a <image>", "images": [png[: len(png) // 2]]},  # truncated
        {"prompt": "a <image>", "images": [str(tmp_path / "missing.png")]},
        {"prompt": "a <image>", "images": [png]},
        {"prompt": "two <image> <image>", "images": [image(7, (9, 9))]},
        "image tokens without images: <image>",
        {"prompt": "fine <image>", "images": [image(7, (9, 9))]},
    ]
    outs = engine.generate(prompts, GREEDY, use_tqdm=False)
    errors = [o.error for o in outs]
    assert [o.finish_reason for o in outs] == ["error"] * 6 + ["length"]
    assert "unreadable image" in errors[0] and "unreadable image" in errors[1]
    assert "missing.png" in errors[2] and "DecompressionBomb" in errors[3]
    assert "2 <image> but 1 images" in errors[4] and "image tokens but no images" in errors[5]


def test_text_model_refuses_images(engine):
    """The built-in text model: a prompt with images fails alone; text rows and an imageless dict run."""
    outs = engine.generate(
        [{"prompt": "Hi <image>", "images": [image(0, (9, 9))]}, {"prompt": "Hi"}, "Hi"],
        SamplingParams(max_tokens=2),
        use_tqdm=False,
    )
    assert outs[0].finish_reason == "error" and "takes no images" in outs[0].error
    assert outs[1].token_ids == outs[2].token_ids and outs[1].finish_reason != "error"


def test_requests_whose_images_do_not_fit_fail_alone(idefics3):
    """Requests built by hand (Engine.stream): tiles of another size, or image tokens that are not the images'."""
    folder, _ = idefics3
    engine = vision_engine(folder)
    made = engine.image_prompter("a <image> b", [image(8, (40, 24))])
    small = dataclasses.replace(made, pixel_values=made.pixel_values[:, :, :8, :8])
    fewer = dataclasses.replace(
        made, pixel_values=made.pixel_values[:1], pixel_attention_mask=made.pixel_attention_mask[:1]
    )
    requests = [
        Request("small", made.token_ids, GREEDY, images=small),
        Request("fewer", made.token_ids, GREEDY, images=fewer),
        Request("fine", made.token_ids, GREEDY, images=made),
    ]
    outs = {o.request_id: o for o in engine.stream(requests)}
    assert "not tiles of this model's" in outs["small"].error
    assert "do not match its image tokens" in outs["fewer"].error
    assert outs["fine"].error is None and len(outs["fine"].token_ids) == MAX_TOKENS


def test_image_steps_read_nothing_back_on_the_host(idefics3):
    """The host-sync guard (the device check's): the encoder and the embedding swap use no data-dependent op, so a
    GPU step with images waits on nothing but its sampled tokens."""
    folder, _ = idefics3
    engine = vision_engine(folder, max_num_batched_tokens=16)
    engine.forbid_host_sync()
    outs = engine.generate([{"prompt": "Row <image> here.", "images": [image(9, (40, 24))]}], GREEDY, use_tqdm=False)
    assert outs[0].error is None and len(outs[0].token_ids) == MAX_TOKENS


@pytest.mark.timeout(30)
def test_image_paths_that_are_not_files_fail_without_blocking(tmp_path):
    """A path to a FIFO (whose open waits for a writer), a device or a folder is refused, not read."""
    import os

    from batchjob.model.vision.images import ImageError, open_image

    fifo = tmp_path / "fifo.png"
    os.mkfifo(fifo)
    for path in (fifo, "/dev/zero", tmp_path):
        with pytest.raises(ImageError, match="not a file"):
            open_image(path)


def test_images_without_pixels_fail_their_row_alone(idefics3):
    """An image 0 pixels wide or high (a PIL image given as it is) fails its row; the processor divides by its
    size, and what it raised ended the whole call."""
    folder, _ = idefics3
    engine = vision_engine(folder)
    prompts = [{"prompt": "a <image>", "images": [Image.new("RGB", size)]} for size in [(5, 0), (0, 5)]]
    outs = engine.generate([*prompts, {"prompt": "fine <image>", "images": [image(7, (9, 9))]}], GREEDY, use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["error", "error", "length"]
    assert all("no pixels" in o.error for o in outs[:2])


def test_images_not_given_as_a_list_raise_before_any_request(idefics3):
    """ "images" is a list (or tuple) of images: one image, bytes, a dict or a number in its place raises TypeError
    up front, as a string there does. Bytes were read as a list of ints and a dict as its keys (paths), and a lone
    PIL image raised from inside the stream, after the rows before it had run."""
    folder, _ = idefics3
    engine = vision_engine(folder)
    for images in [image(1, (9, 9)), png_bytes(image(1, (9, 9))), {"a.png": 1}, 5]:
        with pytest.raises(TypeError, match="a prompt dict is"):
            engine.generate(["hello", {"prompt": "a <image>", "images": images}], GREEDY, use_tqdm=False)
    outs = engine.generate([{"prompt": "a <image>", "images": (image(1, (9, 9)),)}], GREEDY, use_tqdm=False)
    assert outs[0].error is None


def _continuation_nll(engine: Engine, rows, continuations: list[list[int]]) -> float:
    """Mean negative log-likelihood of each row's continuation after its prompt and images, teacher-forced (the
    prompt's logprobs from the continuation's first token on), over every continuation token."""
    requests = []
    for k, ((prompt, images), continuation) in enumerate(zip(rows, continuations)):
        made = engine.image_prompter(prompt, images)
        params = SamplingParams(max_tokens=0, prompt_logprobs=0)
        start = len(made.token_ids)
        requests.append(Request(f"r{k}", made.token_ids + continuation, params, start, images=made))
    outs = list(engine.stream(requests))
    assert all(o.error is None for o in outs), [o.error for o in outs]
    logprobs = [lp.logprob for o in outs for lp in o.prompt_logprobs if lp is not None]
    assert len(logprobs) == sum(map(len, continuations))
    return -sum(logprobs) / len(logprobs)


def test_bf16_image_rows_keep_fp32s_likelihood_within_the_nll_bound(idefics3):
    """bf16 on image rows within the project's NLL bound (`bench --quality`'s for text): the likelihood bf16 gives
    fp32's greedy continuations is within 1 % of fp32's own. With each row's images taken from another row the same
    continuations score further off than that, so the bound does see the images."""
    folder, _ = idefics3
    fp32, bf16 = vision_engine(folder), vision_engine(folder, dtype="bfloat16")
    rows = [
        ("User: what is in <image>? Assistant:", [image(10, (40, 24))]),
        ("<image> first, then <image>:", [image(11, (20, 36)), image(12, (30, 30))]),
        ("Caption:<image>", [image(13, (24, 40))]),
    ]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    continuations = [o.token_ids for o in fp32.generate([{"prompt": p, "images": i} for p, i in rows], params)]
    exact = _continuation_nll(fp32, rows, continuations)
    assert abs(_continuation_nll(bf16, rows, continuations) - exact) <= 0.01 * exact
    swapped = [(rows[0][0], rows[2][1]), (rows[1][0], rows[1][1][::-1]), (rows[2][0], rows[0][1])]
    assert abs(_continuation_nll(fp32, swapped, continuations) - exact) > 0.01 * exact
