"""The `batchjob` command."""
from __future__ import annotations

import click

from batchjob.model_loader import DEFAULT_MODEL


@click.group()
@click.version_option(package_name="batchjob")
def main() -> None:
    """Offline LLM batch inference: continuous batching, paged KV cache, resumable Parquet output."""


@main.command()
@click.argument("prompt")
@click.option("--model", default=DEFAULT_MODEL, show_default=True, help="built-in name, GGUF file or HF folder")
@click.option("--max-tokens", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0.0))
@click.option("--seed", default=None, type=int)
@click.option("--system", default=None, help="system message for the chat template")
@click.option("--no-chat", is_flag=True, help="send the prompt as raw text, without the chat template")
def generate(prompt, model, max_tokens, temperature, seed, system, no_chat) -> None:
    """Complete one PROMPT with the model and print the text."""
    from batchjob.engine import Engine, SamplingParams

    engine = Engine(model)
    tok = engine.tokenizer
    if no_chat:
        ids = tok.encode(prompt)
    else:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        ids = tok.encode_chat(messages)
    [out] = engine.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed))
    click.echo(out.text)


if __name__ == "__main__":
    main()
