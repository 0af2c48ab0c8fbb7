"""README.md and docs/ as a user reads them: every job file in a ```yaml block loads, every `batchjob` line in a
```bash block names a real command with only the options it has, every Python block compiles and its imports
resolve, and every relative link points at a file (and heading) that exists.

A ```yaml block that is part of a job file, not a whole one, starts with the line `# fragment`: it is merged into a
minimal job, so that its keys must still be the job file's keys."""

from __future__ import annotations

import ast
import importlib
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
import yaml

from batchjob.cli import main
from batchjob.job.spec import JobFileError, load_job

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FRAGMENT = "# fragment"
MINIMAL_JOB = {"input": {"path": "in.jsonl"}, "output": {"path": "out/docs"}}
SEPARATORS = {"&&", "||", ";", "|", "&", "(", ")"}
REDIRECTS = {">", ">>", "<", ">&", "&>", "<<"}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    found, lang, start, body = [], None, 0, []
    for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("```"):
            if lang is None:
                lang, start, body = line[3:].strip(), n, []
            else:
                found.append(Block(page, start, lang, "\n".join(body) + "\n"))
                lang = None
        elif lang is not None:
            body.append(line)
    assert lang is None, f"{page}: a fence opened at line {start} is never closed"
    return found


ALL_BLOCKS = [b for page in PAGES for b in blocks(page)]


def of(lang: str) -> list[Block]:
    return [b for b in ALL_BLOCKS if b.lang == lang]


def ids(items: list[Block]) -> list[str]:
    return [b.where for b in items]


# --- job files ---------------------------------------------------------------------------------------------------


def merged(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def job_text(block: Block) -> str:
    """The block as a whole job file: a fragment is merged into a minimal job."""
    if not block.text.lstrip().startswith(FRAGMENT):
        return block.text
    raw = yaml.safe_load(block.text)
    assert isinstance(raw, dict), f"{block.where}: a fragment must be a mapping of job-file keys"
    return yaml.safe_dump(merged(MINIMAL_JOB, raw))


@pytest.mark.parametrize("block", of("yaml"), ids=ids(of("yaml")))
def test_every_yaml_block_is_a_job_file_or_a_fragment_of_one(block, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # a job's relative paths are taken from where batchjob runs: the repository here
    path = tmp_path / "job.yaml"
    path.write_text(job_text(block), encoding="utf-8")
    try:
        job = load_job(path)
    except JobFileError as e:
        pytest.fail(f"{block.where}: {e}")
    if job.input.path.startswith("sample_data/"):
        assert (REPO / job.input.path).exists(), f"{block.where}: {job.input.path} is not in the repository"


@pytest.mark.parametrize("path", sorted((REPO / "jobs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_sample_job_file_loads_and_reads_data_in_the_repository(path):
    job = load_job(path)
    assert (REPO / job.input.path).exists(), f"{path.name}: {job.input.path} is not in the repository"


def test_a_fragment_with_an_unknown_key_is_caught(tmp_path):
    bad = Block(REPO / "README.md", 0, "yaml", f"{FRAGMENT}\nsampling:\n  max_tokenz: 8\n")
    path = tmp_path / "job.yaml"
    path.write_text(job_text(bad))
    with pytest.raises(JobFileError, match="max_tokenz"):
        load_job(path)


# --- commands ----------------------------------------------------------------------------------------------------


def shell_lines(text: str) -> list[str]:
    """The block's commands, continuation lines joined."""
    lines, pending = [], ""
    for line in text.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def segments(line: str) -> list[list[str]]:
    """A command line's simple commands (split at &&, ||, ;, |, parentheses), with leading VAR=value assignments and
    redirections taken out."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    out, current = [], []
    for token in lexer:
        if token in SEPARATORS:
            out.append(current)
            current = []
        else:
            current.append(token)
    out.append(current)
    cleaned = []
    for tokens in out:
        while tokens and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", tokens[0]):
            tokens = tokens[1:]
        kept, skip = [], False
        for k, token in enumerate(tokens):
            if skip:
                skip = False
            elif token in REDIRECTS:
                skip = True
                if kept and kept[-1].isdigit() and k > 0 and tokens[k - 1] == kept[-1]:
                    kept.pop()  # the 2 of 2>/dev/null
            else:
                kept.append(token)
        if kept:
            cleaned.append(kept)
    return cleaned


def problems(argv: list[str]) -> list[str]:
    """What is wrong with a `batchjob ...` command: an unknown command or option, a missing or extra argument, a value
    its option does not take, or, for a job file in the repository, a `--set` key the job file does not have."""
    if len(argv) < 2:
        return ["no command"]
    name, args = argv[1], argv[2:]
    cmd = main.commands.get(name)
    if cmd is None:
        return [f"no command {name!r} (there are {', '.join(sorted(main.commands))})"]
    ctx = click.Context(cmd, info_name=name)
    try:
        values, extra, _ = cmd.make_parser(ctx).parse_args(list(args))
    except click.UsageError as e:
        return [e.format_message()]
    found = [f"unexpected arguments {extra}"] if extra else []
    for param in cmd.params:
        value = values.get(param.name)
        if isinstance(param, click.Argument):
            if param.required and not isinstance(value, str):
                found.append(f"missing argument {param.human_readable_name}")
            continue
        if not isinstance(value, (str, list, tuple, bool)) or isinstance(param.type, click.Path):
            continue  # not given (or a path, which may not exist here)
        try:
            converted = param.type_cast_value(ctx, value)
            if param.callback is not None:
                param.callback(ctx, param, converted)
        except click.BadParameter as e:
            found.append(e.format_message())
    job_file = values.get("job_file")
    if not found and isinstance(job_file, str) and (REPO / job_file).is_file():
        try:
            load_job(REPO / job_file, tuple(values.get("overrides") or ()))
        except JobFileError as e:
            found.append(str(e))
    return found


def batchjob_commands(block: Block) -> list[list[str]]:
    commands = []
    for line in shell_lines(block.text):
        for tokens in segments(line):
            if tokens[0] == "batchjob" or tokens[0].endswith("/batchjob"):
                commands.append(tokens)
    return commands


def scripts(block: Block) -> list[str]:
    """Repository files the block runs: `python scripts/x.py`, `scripts/x.sh`."""
    found = []
    for line in shell_lines(block.text):
        for tokens in segments(line):
            if tokens[0] in ("python", "python3") and len(tokens) > 1 and tokens[1].endswith(".py"):
                found.append(tokens[1])
            elif tokens[0].startswith("scripts/"):
                found.append(tokens[0])
    return found


@pytest.mark.parametrize("block", of("bash"), ids=ids(of("bash")))
def test_every_command_in_a_bash_block_exists_with_its_options(block, monkeypatch):
    monkeypatch.chdir(REPO)
    wrong = {" ".join(argv): p for argv in batchjob_commands(block) if (p := problems(argv))}
    assert not wrong, f"{block.where}: {wrong}"
    missing = [s for s in scripts(block) if not (REPO / s).is_file()]
    assert not missing, f"{block.where}: no such file {missing}"


def test_the_docs_show_every_command():
    shown = {argv[1] for b in of("bash") for argv in batchjob_commands(b)}
    assert {"plan", "run", "status", "report", "bench", "selftest"} <= shown


def test_the_command_check_catches_mistakes(monkeypatch):
    monkeypatch.chdir(REPO)
    assert problems(["batchjob", "run", "jobs/summarize.yaml"]) == []
    assert any("--no-such-flag" in p for p in problems(["batchjob", "run", "x.yaml", "--no-such-flag"]))
    assert problems(["batchjob", "frobnicate"])
    assert problems(["batchjob", "status"])  # its FOLDER is missing
    assert problems(["batchjob", "status", "a", "b"])  # one too many
    assert problems(["batchjob", "run", "x.yaml", "--log-format", "xml"])
    assert problems(["batchjob", "bench", "--sweep-budgets", "8"])
    assert problems(["batchjob", "run", "jobs/summarize.yaml", "--set", "engine.no_such_key=1"])
    block = Block(REPO / "README.md", 0, "bash", "pip install x && batchjob plan jobs/summarize.yaml --jsn 2>&1\n")
    assert [problems(argv) != [] for argv in batchjob_commands(block)] == [True]


# --- Python ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block", of("python"), ids=ids(of("python")))
def test_every_python_block_compiles_and_its_imports_resolve(block):
    tree = compile(block.text, block.where, "exec", ast.PyCF_ONLY_AST)
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{block.where}: {node.module} has no {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)


# --- links and pages ---------------------------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.M | re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_relative_link_points_at_a_file_and_heading(page):
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.M | re.S)
    wrong = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            wrong.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            wrong.append(f"{target}: no heading #{anchor} in {file.name}")
    assert not wrong, f"{page.relative_to(REPO)}: {wrong}"


def test_the_readme_is_short_and_keeps_the_lab_notebook_out():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    assert not re.findall(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", text), "commit hashes"
    assert not re.findall(r"\bissue \d+", text, re.I), "internal issue numbers"
    assert not re.findall(r"\d\d:\d\d UTC|\bload (average )?\d", text), "timestamps or load figures"


def test_the_environment_page_lists_every_variable_batchjob_reads():
    from batchjob import env

    page = (REPO / "docs" / "environment.md").read_text(encoding="utf-8")
    assert [name for name in env.VARIABLES if f"`{name}`" not in page] == []


def test_the_pictures_are_small():
    assert all(p.stat().st_size < 200_000 for p in (REPO / "docs" / "img").iterdir())
