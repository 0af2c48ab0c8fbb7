#!/usr/bin/env python3
"""Rebuild the sample data in this folder from texts shipped in packages.

Usage (from the repository root, with pyarrow importable):

    python sample_data/build.py

Sources (see README.md for versions and licences):

* Debian ``r-cran-janeaustenr``: Jane Austen's six novels (public domain).
* Debian ``miscfiles``: the US Constitution and Declaration of Independence
  (public domain).
* Debian ``python3.11-doc``: reST sources of the Python FAQ, tutorial and
  HOWTOs (PSF License).
* The running interpreter's standard library: module docstrings (PSF License).

A Debian package that is installed is read in place; one that is not is
fetched with ``apt-get download`` (run ``apt-get update`` first) into a
temporary folder and unpacked with ``dpkg-deb -x``; nothing gets installed.
The selection is deterministic: the same package versions give the same files.
"""

from __future__ import annotations

import ast
import bz2
import glob
import gzip
import json
import lzma
import math
import os
import random
import re
import shutil
import statistics
import struct
import subprocess
import sys
import sysconfig
import tempfile
import zlib

import pyarrow as pa
import pyarrow.parquet as pq

HERE = os.path.dirname(os.path.abspath(__file__))
MIN_WORDS, MAX_WORDS = 40, 1500
SEED = 20240601

AUSTEN_DATA = "usr/lib/R/site-library/janeaustenr/data"
STATE_DIR = "usr/share/state"
PYDOC_SOURCES = "usr/share/doc/python3.11/html/_sources"

_TMP = None
_ROOTS: dict[str, tuple[str, str, str]] = {}
SOURCES: dict[str, dict] = {}  # source key -> provenance, filled while building


# --------------------------------------------------------------------------
# Getting at the files of a Debian package


def deb_root(package: str, probe: str) -> tuple[str, str, str]:
    """Return (root folder, version, how) for a Debian package holding `probe`."""
    if package not in _ROOTS:
        _ROOTS[package] = _deb_root(package, probe)
    return _ROOTS[package]


def _deb_root(package: str, probe: str) -> tuple[str, str, str]:
    if os.path.exists("/" + probe):
        ver = subprocess.run(
            ["dpkg-query", "-W", "-f=${Version}", package],
            capture_output=True, text=True,
        ).stdout.strip()
        return "/", ver or "unknown", "installed"
    global _TMP
    if _TMP is None:
        _TMP = tempfile.mkdtemp(prefix="batchjob-sample-data-")
    dl = os.path.join(_TMP, "debs")
    os.makedirs(dl, exist_ok=True)
    try:
        subprocess.run(["apt-get", "-o", "APT::Sandbox::User=root", "download", package], cwd=dl, check=True,
                       stdout=subprocess.DEVNULL)
    except (OSError, subprocess.CalledProcessError) as e:
        sys.exit(f"cannot get Debian package {package} ({e}); "
                 f"run 'apt-get update' first, or 'apt-get install {package}'")
    deb = sorted(glob.glob(os.path.join(dl, f"{package}_*.deb")))[-1]
    root = os.path.join(_TMP, package)
    subprocess.run(["dpkg-deb", "-x", deb, root], check=True)
    ver = subprocess.run(["dpkg-deb", "-f", deb, "Version"], capture_output=True,
                         text=True, check=True).stdout.strip()
    return root, ver, "apt-get download"


# --------------------------------------------------------------------------
# A minimal reader for R's serialization format (enough for character vectors
# and named lists), used on the lazy-load database of an installed R package.


class _RReader:
    def __init__(self, data: bytes):
        self.b, self.p, self.refs = data, 0, []

    def int(self) -> int:
        (v,) = struct.unpack_from(">i", self.b, self.p)
        self.p += 4
        return v

    def header(self) -> None:
        if self.b[:2] != b"X\n":
            raise ValueError("not an XDR R serialization")
        self.p = 2
        version = self.int()
        self.int(), self.int()  # writer's R version, minimal R version
        if version == 3:
            n = self.int()  # length of the native encoding name
            self.p += n

    def item(self):
        flags = self.int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind in (254, 253, 242, 241, 251):  # NULL, envs, missing arg
            return None
        if kind == 255:  # reference to an earlier symbol
            return self.refs[(flags >> 8) - 1]
        if kind == 1:  # symbol
            sym = ("sym", self.item())
            self.refs.append(sym)
            return sym
        if kind in (2, 6, 17):  # pairlist, call, dots
            if has_attr:
                self.item()
            tag = self.item() if has_tag else None
            car, cdr = self.item(), self.item()
            return [(tag, car)] + (cdr or [])
        if kind == 9:  # CHARSXP
            n = self.int()
            if n == -1:
                return None
            s = self.b[self.p:self.p + n].decode("utf-8")
            self.p += n
            return s
        if kind in (10, 13, 14, 16, 19, 20):
            n = self.int()
            if kind in (10, 13):
                v = list(struct.unpack_from(f">{n}i", self.b, self.p))
                self.p += 4 * n
            elif kind == 14:
                v = list(struct.unpack_from(f">{n}d", self.b, self.p))
                self.p += 8 * n
            else:
                v = [self.item() for _ in range(n)]
            if has_attr:
                attrs = {tag[1]: val for tag, val in self.item()}
                if attrs.get("names"):
                    return dict(zip(attrs["names"], v))
            return v
        raise ValueError(f"unsupported R object type {kind}")


def r_unserialize(data: bytes):
    r = _RReader(data)
    r.header()
    return r.item()


def r_lazyload(folder: str, stem: str = "Rdata") -> dict:
    """Read every variable of an R lazy-load database (stem.rdx + stem.rdb)."""
    with gzip.open(os.path.join(folder, stem + ".rdx")) as f:
        index = r_unserialize(f.read())
    with open(os.path.join(folder, stem + ".rdb"), "rb") as f:
        db = f.read()
    out = {}
    for name, (off, length) in index["variables"].items():
        blob = db[off:off + length]
        kind = blob[4:5]
        if kind == b"Z":
            raw = lzma.decompress(blob[5:])
        elif kind == b"2":
            raw = bz2.decompress(blob[5:])
        elif kind == b"0":
            raw = blob[5:]
        else:
            raw = zlib.decompress(blob[4:])
        out[name] = r_unserialize(raw)
    return out


# --------------------------------------------------------------------------
# Helpers


def words(text: str) -> int:
    return len(text.split())


def squash(lines) -> str:
    return re.sub(r"\s+", " ", " ".join(lines)).strip()


def paragraphs(lines) -> list[str]:
    """Blank-line separated paragraphs, each joined onto one line."""
    out, cur = [], []
    for line in lines:
        if line.strip():
            cur.append(line.strip())
        elif cur:
            out.append(squash(cur))
            cur = []
    if cur:
        out.append(squash(cur))
    return out


# --------------------------------------------------------------------------
# Jane Austen

NOVELS = [  # (variable in janeaustenr, title, year)
    ("sensesensibility", "Sense and Sensibility", 1811),
    ("prideprejudice", "Pride and Prejudice", 1813),
    ("mansfieldpark", "Mansfield Park", 1814),
    ("emma", "Emma", 1815),
    ("northangerabbey", "Northanger Abbey", 1818),
    ("persuasion", "Persuasion", 1818),
]
PASSAGES_PER_NOVEL = 19
CHAPTER_RE = re.compile(r"^\s*chapter\s+([0-9]+|[ivxlc]+)\.?\s*$", re.I)


def austen_chapters(lines: list[str]) -> list[tuple[str, list[str]]]:
    """(chapter label, paragraphs) for each chapter; volume numbers restart."""
    chapters, label, cur, volume = [], None, [], 0
    for line in lines:
        if re.match(r"^\s*volume\s+[ivx]+\s*$", line, re.I):
            volume += 1
            continue
        m = CHAPTER_RE.match(line)
        if m:
            if label:
                chapters.append((label, cur))
            num = m.group(1).upper()
            label = f"Volume {volume}, Chapter {num}" if volume else f"Chapter {num}"
            cur = []
        elif label:
            cur.append(line)
    if label:
        chapters.append((label, cur))
    out = []
    for label, body in chapters:
        paras = []
        for p in paragraphs(body):
            p = p.replace("_", "")  # _italics_ in the Gutenberg transcription
            if re.fullmatch(r"[*\s.]*|THE END|FINIS", p):
                continue
            paras.append(p)
        out.append((label, paras))
    return out


def austen_docs() -> list[dict]:
    root, ver, how = deb_root("r-cran-janeaustenr", AUSTEN_DATA + "/Rdata.rdb")
    SOURCES["austen"] = dict(package="r-cran-janeaustenr", version=ver, how=how,
                             path="/" + AUSTEN_DATA + "/Rdata.rdb")
    data = r_lazyload(os.path.join(root, AUSTEN_DATA))
    rng = random.Random(SEED)
    docs = []
    for var, title, year in NOVELS:
        chapters = austen_chapters(data[var])
        n = PASSAGES_PER_NOVEL
        for k in range(n):
            label, paras = chapters[(k * len(chapters)) // n + rng.randrange(2)]
            # log-uniform target length, so short and long passages both occur
            target = int(math.exp(rng.uniform(math.log(MIN_WORDS), math.log(MAX_WORDS))))
            # start where the rest of the chapter is long enough, if anywhere
            tail = [sum(map(words, paras[i:])) for i in range(len(paras))]
            fits = [i for i in range(len(paras)) if tail[i] >= target] or [0]
            start = fits[rng.randrange(len(fits))]
            chosen = []
            i = start
            while i < len(paras) and sum(map(words, chosen)) < target:
                if sum(map(words, chosen)) + words(paras[i]) > MAX_WORDS:
                    break
                chosen.append(paras[i])
                i += 1
            j = start - 1
            while sum(map(words, chosen)) < MIN_WORDS and j >= 0:
                chosen.insert(0, paras[j])
                j -= 1
            text = "\n\n".join(chosen)
            if not MIN_WORDS <= words(text) <= MAX_WORDS:
                continue
            docs.append(dict(
                title=f"{title} ({year}), {label}, from paragraph {j + 2}",
                source="austen", text=text))
    return docs


# --------------------------------------------------------------------------
# US Constitution and Declaration of Independence


def constitution_docs() -> list[dict]:
    root, ver, how = deb_root("miscfiles", STATE_DIR + "/us-constitution.gz")
    SOURCES["us-founding-documents"] = dict(
        package="miscfiles", version=ver, how=how,
        path=f"/{STATE_DIR}/us-constitution.gz, /{STATE_DIR}/us-declaration.gz")
    with gzip.open(os.path.join(root, STATE_DIR, "us-constitution.gz"), "rt",
                   encoding="utf-8") as f:
        lines = f.read().splitlines()

    # Units: the Preamble, each Section of Article I, each other Article and
    # each Amendment as a whole.
    units, title, body, article = [], None, [], None
    for line in lines:
        s = line.strip()
        head = re.fullmatch(r"(Preamble|Article [IVX]+|Amendment [IVXL]+|Amendments)", s)
        sect = re.fullmatch(r"Section \d+", s)
        if head or (sect and article == "Article I"):
            if title and body:
                units.append((title, body))
            body = []
            if head:
                article = s
                title = None if s == "Amendments" else s
                if s == "Article I":
                    title = None
            else:
                title = f"{article}, {s}"
        elif title:
            body.append(line)
    if title and body:
        units.append((title, body))

    # A unit under MIN_WORDS joins the one before it if that is of the same kind
    # (Article, Amendment), else the one after it; joined units keep headings.
    groups, carry = [], []
    for title, body in units:
        text = "\n\n".join(p for p in paragraphs(body)
                           if not re.match(r"(Passed by Congress|Ratified|Note:)", p))
        kind = title.split()[0]
        if (words(text) < MIN_WORDS and not carry and groups
                and groups[-1][-1][0].split()[0] == kind):
            groups[-1].append((title, text))
            continue
        carry.append((title, text))
        if sum(words(x) for _, x in carry) >= MIN_WORDS:
            groups.append(carry)
            carry = []
    if carry:
        groups[-1].extend(carry)
    docs = []
    for group in groups:
        if len(group) == 1:
            text = group[0][1]
        else:
            text = "\n\n".join(f"{t}\n\n{x}" for t, x in group)
        docs.append(dict(title="Constitution of the United States, " + "; ".join(t for t, _ in group),
                         source="us-founding-documents", text=text))

    with gzip.open(os.path.join(root, STATE_DIR, "us-declaration.gz"), "rt",
                   encoding="utf-8") as f:
        paras = paragraphs(f.read().splitlines())
    docs.append(dict(title="The Declaration of Independence (1776)",
                     source="us-founding-documents", text="\n\n".join(paras[1:])))
    return docs


# --------------------------------------------------------------------------
# Python documentation (reStructuredText sources shipped in python3.11-doc)

PYDOC_FILES = [
    "faq/general", "faq/design", "faq/library", "faq/programming",
    "faq/windows", "faq/extending", "faq/gui", "faq/installed",
    "tutorial/appetite", "tutorial/interpreter", "tutorial/floatingpoint",
    "tutorial/stdlib", "tutorial/stdlib2", "tutorial/venv", "tutorial/whatnow",
    "tutorial/interactive", "tutorial/modules", "tutorial/errors",
    "howto/sockets", "howto/unicode", "howto/pyporting", "howto/functional",
]
PYDOC_MAX_DOCS = 55
HEADING_UNDERLINE = re.compile(r"^([=\-~^*#\"'])\1{2,}\s*$")
DROP_DIRECTIVES = {
    "only", "contents", "index", "toctree", "highlight", "testsetup",
    "testcleanup", "sectionauthor", "moduleauthor", "module", "currentmodule",
    "image", "figure", "raw", "include", "literalinclude", "tabularcolumns",
    "rubric", "impl-detail", "productionlist",
}


def rst_inline(s: str) -> str:
    """Strip inline reST markup (roles, links, literals, emphasis) from prose."""
    s = re.sub(r":pep:`(\d+)`", r"PEP \1", s)
    s = re.sub(r":rfc:`(\d+)`", r"RFC \1", s)
    s = re.sub(r":[\w:.+-]+:`([^`<]*?)\s*<[^`>]*>`", r"\1", s)         # :ref:`text <t>`
    s = re.sub(r":ref:`([^`]*)`", lambda m: m.group(1).replace("-", " "), s)
    s = re.sub(r":[\w:.+-]+:`~(?:[\w.]*\.)?([^`]*)`", r"\1", s)      # :func:`~a.b`
    s = re.sub(r":[\w:.+-]+:`!?([^`]*)`", r"\1", s)                  # :func:`a.b`
    s = re.sub(r"`([^`<]*?)\s*<[^`>]*>`__?", r"\1", s)               # `text <url>`_
    s = re.sub(r"``(.+?)``", r"\1", s, flags=re.S)
    s = re.sub(r"`([^`]+)`_{0,2}", r"\1", s)
    s = re.sub(r"\*\*(\S(?:.*?\S)?)\*\*", r"\1", s, flags=re.S)
    s = re.sub(r"(?<![\w*])\*(\S(?:[^*]*?\S)?)\*(?![\w*])", r"\1", s)
    s = re.sub(r"\s*\[(#\w*|\d+|\*)\]_", "", s)                      # footnote refs
    s = s.replace("|version|", "3.11").replace("|release|", "3.11")
    s = s.replace("\\ ", "").replace("\\*", "*")
    return s


def rst_sections(text: str) -> tuple[str, list[tuple[str, list[str]]]]:
    """(document title, [(section heading, cleaned lines)]) of a reST file."""
    lines = text.splitlines()
    out, heading, cur, doc_title = [], None, [], None
    i, skip_indent = 0, None
    while i < len(lines):
        line = lines[i]
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        indent = len(line) - len(line.lstrip())
        if skip_indent is not None:  # inside a dropped directive body
            if not line.strip() or indent > skip_indent:
                i += 1
                continue
            skip_indent = None
        if HEADING_UNDERLINE.match(line):  # overline or stray rule
            i += 1
            continue
        if line.strip() and HEADING_UNDERLINE.match(nxt) and indent == 0:
            if heading is not None or cur:
                out.append((heading, cur))
            heading = rst_inline(line.strip())  # headings are one line
            doc_title = doc_title or heading
            cur = []
            i += 2
            continue
        m = re.match(r"^(\s*)\.\.\s+([\w:-]+)::(.*)$", line)
        if m:
            name = m.group(2).split(":")[-1]
            if name in DROP_DIRECTIVES:
                skip_indent = indent
            elif name in ("note", "warning", "seealso", "tip", "important"):
                label = {"seealso": "See also"}.get(name, name.capitalize())
                arg = m.group(3).strip()
                cur.append(m.group(1) + f"{label}: {arg}".rstrip())
            elif name in ("versionadded", "versionchanged", "deprecated"):
                label = {"versionadded": "New in version",
                         "versionchanged": "Changed in version",
                         "deprecated": "Deprecated since version"}[name]
                cur.append(m.group(1) + f"{label} {m.group(3).strip()}.")
            else:  # code-block, doctest, ...: keep the body as a literal block
                cur += ["", m.group(1) + "::", ""]
            i += 1
            while i < len(lines) and re.match(r"^\s+:[\w-]+:", lines[i]):
                i += 1  # directive options
            continue
        if re.match(r"^\s*\.\.(\s|$)", line):  # comment or link target
            skip_indent = indent
            i += 1
            continue
        cur.append(line.rstrip())
        i += 1
    if heading is not None or cur:
        out.append((heading, cur))
    return doc_title, out


def rst_to_text(lines: list[str]) -> str:
    """Join prose paragraphs and strip inline markup; literal blocks (after
    '::' or a code directive) and doctest blocks are kept as they are."""
    blocks, cur, literal = [], [], False
    for line in lines + [""]:
        if line.strip():
            cur.append(line)
            continue
        if not cur:
            continue
        base = min(len(l) - len(l.lstrip()) for l in cur)
        block = [l[base:] for l in cur]
        cur = []
        if block == ["::"]:
            literal = True
            continue
        if (literal and base > 0) or block[0].startswith(">>>"):
            blocks.append("\n".join(block))
            continue
        literal = block[-1].endswith("::")
        if literal:
            block[-1] = re.sub(r"\s*::$", "", block[-1]) if re.search(r"\s::$", block[-1]) \
                else block[-1][:-1]
        if any(re.match(r"([-*+]|\d+\.|#\.)\s", l) for l in block):
            text = rst_inline("\n".join(block))  # a list: keep its lines
        else:
            text = rst_inline(squash(block))
        if text.strip():
            blocks.append(text)
    return "\n\n".join(blocks)


def pydoc_docs() -> list[dict]:
    root, ver, how = deb_root("python3.11-doc", PYDOC_SOURCES + "/faq/general.rst.txt")
    SOURCES["python-docs"] = dict(package="python3.11-doc", version=ver, how=how,
                                  path="/" + PYDOC_SOURCES + "/{faq,tutorial,howto}/*.rst.txt")
    candidates = []
    for name in PYDOC_FILES:
        path = os.path.join(root, PYDOC_SOURCES, name + ".rst.txt")
        with open(path, encoding="utf-8") as f:
            doc_title, sections = rst_sections(f.read())
        for heading, lines in sections:
            if heading is None or heading == doc_title:
                continue
            text = rst_to_text(lines)
            code = sum(1 for b in text.split("\n\n") if "\n" in b or b.startswith(">>>"))
            blocks = max(1, text.count("\n\n") + 1)
            if MIN_WORDS <= words(text) <= MAX_WORDS and code / blocks <= 0.4:
                candidates.append(dict(title=f"Python 3.11 documentation, {doc_title}: {heading}",
                                       source="python-docs", text=text))
    rng = random.Random(SEED + 1)
    keep = sorted(rng.sample(range(len(candidates)), min(PYDOC_MAX_DOCS, len(candidates))))
    return [candidates[k] for k in keep]


# --------------------------------------------------------------------------
# Module docstrings of the standard library

STDLIB_MAX_DOCS = 40


def prose_ratio(text: str) -> float:
    toks = text.split()
    good = sum(1 for t in toks if re.fullmatch(r"[(\"']?[A-Za-z][a-z'-]*[.,;:!?)\"']*", t))
    return good / max(1, len(toks))


def stdlib_docs() -> list[dict]:
    stdlib = sysconfig.get_paths()["stdlib"]
    SOURCES["python-stdlib"] = dict(
        package=f"CPython {sys.version.split()[0]} standard library (the interpreter running build.py)",
        version=sys.version.split()[0], how="installed", path=stdlib + "/**/*.py")
    candidates = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(("test", "idle_test"))
                             and d not in ("site-packages", "__pycache__", "lib2to3"))
        for fn in sorted(filenames):
            if not fn.endswith(".py"):
                continue
            path = os.path.join(dirpath, fn)
            try:
                with open(path, encoding="utf-8") as f:
                    doc = ast.get_docstring(ast.parse(f.read()))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            if doc:  # drop version-control keywords such as "$Id$"
                doc = re.sub(r"(?m)^\s*\$\w+(:[^$]*)?\$\s*$", "", doc).strip()
            if not doc or not MIN_WORDS <= words(doc) <= MAX_WORDS:
                continue
            if prose_ratio(doc) < 0.8:
                continue
            mod = os.path.relpath(path, stdlib)[:-3].replace(os.sep, ".")
            mod = mod.removesuffix(".__init__")
            candidates.append(dict(title=f"Docstring of the Python module {mod}",
                                   source="python-stdlib", text=doc.strip()))
    rng = random.Random(SEED + 2)
    keep = sorted(rng.sample(range(len(candidates)), min(STDLIB_MAX_DOCS, len(candidates))))
    return [candidates[k] for k in keep]


# --------------------------------------------------------------------------
# Outputs

SCHEMA = pa.schema([("id", pa.string()), ("title", pa.string()),
                    ("source", pa.string()), ("text", pa.string())])


def write_documents(docs: list[dict]) -> None:
    table = pa.Table.from_pylist(docs, schema=SCHEMA)
    pq.write_table(table, os.path.join(HERE, "documents.parquet"), compression="zstd")
    with open(os.path.join(HERE, "documents.jsonl"), "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")


def write_bad_rows(docs: list[dict]) -> list[tuple[str, str]]:
    """bad_rows.jsonl: one case per line; written in binary (one line is not UTF-8)."""
    by_len = sorted(docs, key=lambda d: words(d["text"]))
    short, mid = by_len[5], by_len[len(by_len) // 2]
    longest = by_len[-1]
    reps = 10_000 // words(longest["text"]) + 2
    huge = "\n\n".join([longest["text"]] * reps)

    def row(id_, **fields):
        return json.dumps({"id": id_, **fields}, ensure_ascii=False).encode("utf-8")

    good = lambda n, d: row(f"bad-ok-{n}", title=d["title"], source=d["source"], text=d["text"])
    cases = [
        ("bad-ok-1", "good row", good(1, short)),
        ("bad-missing-text", "no text field at all",
         row("bad-missing-text", title="row without text", source="test")),
        ("bad-null-text", "text is null",
         row("bad-null-text", title="row with null text", source="test", text=None)),
        ("bad-number-text", "text is a number",
         row("bad-number-text", title="row with numeric text", source="test", text=12345)),
        ("bad-ok-2", "good row", good(2, mid)),
        ("(no id)", "malformed JSON: not parseable at all",
         b'{"id": "bad-malformed-json", "title": "truncated row", "text": "It is a truth'
         b' universally acknowledged, that'),
        ("bad-list-text", "text is a list",
         row("bad-list-text", title="row with list text", source="test",
             text=["It is a truth", "universally acknowledged"])),
        ("bad-invalid-utf8", "text holds the raw bytes FF FE, so the line is not valid UTF-8",
         b'{"id": "bad-invalid-utf8", "title": "row with invalid UTF-8", "source": "test", '
         b'"text": "Invalid bytes here: \xff\xfe and after."}'),
        ("bad-empty-text", "text is the empty string",
         row("bad-empty-text", title="row with empty text", source="test", text="")),
        ("bad-too-long", f"text of {words(huge):,} words, roughly 15,000-18,000 tokens "
                         f"({reps} copies of the longest document)",
         row("bad-too-long", title=f"{longest['title']} (repeated {reps} times)",
             source=longest["source"], text=huge)),
        ("bad-ok-3", "good row", good(3, longest)),
    ]
    with open(os.path.join(HERE, "bad_rows.jsonl"), "wb") as f:
        for _, _, line in cases:
            f.write(line + b"\n")
    return [(i, what) for i, what, _ in cases]


def write_broken_parquet(docs: list[dict]) -> int:
    """broken.parquet: a real Parquet file (magic 'PAR1' at the start) cut in half."""
    table = pa.Table.from_pylist(docs[:50], schema=SCHEMA)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    data = sink.getvalue().to_pybytes()
    cut = data[: len(data) // 2]
    with open(os.path.join(HERE, "broken.parquet"), "wb") as f:
        f.write(cut)
    return len(data)


LICENCES = {
    "austen": (
        "Jane Austen's six completed novels, *Sense and Sensibility* (1811), *Pride and "
        "Prejudice* (1813), *Mansfield Park* (1814), *Emma* (1815), *Northanger Abbey* "
        "(1818) and *Persuasion* (1818), as transcribed by Project Gutenberg and packaged "
        "by Julia Silge in the R package janeaustenr 1.0.0 (CRAN). The texts are stored "
        "in the package's lazy-load database, which build.py reads with a small reader "
        "for R's serialization format. Documents are passages of consecutive paragraphs "
        "from one chapter, with a length drawn at random (log-uniform, seeded); the "
        "`_underscores_` that mark italics in the transcription are removed.",
        "The novels are in the **public domain** (first published 1811-1818; the author "
        "died in 1817). The R package around them is MIT-licensed, Copyright 2016-2017 "
        "Julia Silge (see LICENSES.txt)."),
    "us-founding-documents": (
        "The Constitution of the United States (transcript of the National Archives "
        "text) and the Declaration of Independence, as shipped by Debian's miscfiles "
        "package (its debian/addons files, installed to /usr/share/state). Documents are "
        "the Preamble, each Section of Article I, each other Article, each Amendment "
        "(an amendment or section under 40 words is merged into the next one) and the "
        "whole Declaration with its signers.",
        "**Public domain** (documents of 1776-1992, works of the US government; Debian's "
        "copyright file lists these files as public-domain)."),
    "python-docs": (
        "Sections of the Python 3.11 documentation (the FAQ, parts of the tutorial and a "
        "few HOWTOs), from the reStructuredText sources (`_sources/*.rst.txt`) that "
        "Debian's python3.11-doc package ships with the HTML docs. build.py strips the "
        "reST markup (roles, links, directives, headings); code examples are kept as "
        "indented blocks, and sections that are mostly code are skipped.",
        "**PSF License Agreement** for Python 3.11 (Copyright © 2001-2023 Python "
        "Software Foundation; All Rights Reserved); code in the documentation is also "
        "under the Zero-Clause BSD licence. Full text in LICENSES.txt."),
    "python-stdlib": (
        "Module docstrings of the CPython standard library, read with `ast` from the "
        "source files of the interpreter that runs build.py (so not imported). Only "
        "docstrings of 40-1,500 words that are mostly plain words are candidates "
        "(no tests, no lib2to3); a seeded sample of them is kept.",
        "**PSF License Agreement** (Copyright © 2001-2023 Python Software Foundation; "
        "All Rights Reserved). Full text in LICENSES.txt."),
}


def write_licences() -> None:
    """LICENSES.txt: the licence texts that the sources ask to keep with copies."""
    parts = ["Licences of the texts in this folder (see README.md for which applies where).\n"]
    psf = os.path.join(sysconfig.get_paths()["stdlib"], "LICENSE.txt")
    if os.path.exists(psf):
        with open(psf, encoding="utf-8") as f:
            parts.append("=" * 72 + "\nPython (documentation and standard library): "
                         f"{psf} of the interpreter that ran build.py\n" + "=" * 72
                         + "\n\n" + f.read())
    else:
        parts.append("Python: PSF License Agreement, see https://docs.python.org/3.11/license.html")
    root, _, _ = deb_root("r-cran-janeaustenr", AUSTEN_DATA + "/Rdata.rdb")
    with open(os.path.join(root, "usr/share/doc/r-cran-janeaustenr/copyright"), encoding="utf-8") as f:
        parts.append("=" * 72 + "\njaneaustenr (the R package around the public-domain novels): "
                     "/usr/share/doc/r-cran-janeaustenr/copyright\n" + "=" * 72 + "\n\n" + f.read())
    parts.append("=" * 72 + "\nThe US Constitution and Declaration of Independence: public domain.\n")
    with open(os.path.join(HERE, "LICENSES.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(parts))


def debian_release() -> str:
    try:
        with open("/etc/os-release", encoding="utf-8") as f:
            info = dict(l.strip().split("=", 1) for l in f if "=" in l)
        return f" ({info['VERSION_CODENAME'].strip(chr(34))})"
    except (OSError, KeyError, ValueError):
        return ""


def write_readme(docs, bad_cases, parquet_full_size) -> None:
    lens = [words(d["text"]) for d in docs]
    q = statistics.quantiles(lens, n=10)
    def stats(ls):
        return f"{min(ls)} / {int(statistics.median(ls))} / {max(ls)}"
    buckets = [(40, 100), (100, 250), (250, 500), (500, 1000), (1000, 1501)]
    hist = " | ".join(f"{a}-{b - 1 if b == 1501 else b - 1}: {sum(a <= n < b for n in lens)}"
                      for a, b in buckets)
    size = lambda name: os.path.getsize(os.path.join(HERE, name))
    lines = [
        "# Sample data",
        "",
        "Real English prose for trying and testing batchjob: novels, founding documents, "
        "and Python documentation. Nothing here is generated or machine-written; every "
        "text comes out of a package from Debian or the Python interpreter and is public "
        "domain or under the PSF License. Rebuild everything with:",
        "",
        "    python sample_data/build.py      # needs pyarrow; uses apt-get download for Debian packages not installed",
        "",
        "build.py also writes this README (the numbers below come from the data), so edit "
        "build.py rather than this file. The selection is seeded: the same package versions "
        "give byte-identical files.",
        "",
        "## Files",
        "",
        "| file | what | rows | size |",
        "| --- | --- | --- | --- |",
        f"| documents.parquet | the documents; columns `id` (string, unique, `doc-0001`...), "
        f"`title`, `source`, `text` (all strings); zstd-compressed | {len(docs)} | {size('documents.parquet'):,} B |",
        f"| documents.jsonl | the same rows in the same order, one JSON object a line, UTF-8 | "
        f"{len(docs)} | {size('documents.jsonl'):,} B |",
        f"| bad_rows.jsonl | deliberately bad input, one case a line (below) | {len(bad_cases)} lines | "
        f"{size('bad_rows.jsonl'):,} B |",
        f"| broken.parquet | the first half of a valid {parquet_full_size:,}-byte Parquet file of "
        f"50 documents: starts with the `PAR1` magic, but the footer is gone, so no reader "
        f"can open it | - | {size('broken.parquet'):,} B |",
        "| LICENSES.txt | full licence texts that the sources ask to keep with copies | - | - |",
        "| build.py | the script that makes all of the above | - | - |",
        "",
        "## Lengths",
        "",
        "Words are whitespace-separated tokens; a model tokenizer gives roughly 1.3 to 1.5 "
        "tokens a word for this prose (more for code-heavy Python docs).",
        "",
        f"- all documents, words min / median / max: {stats(lens)}; "
        f"10th percentile {int(q[0])}, 90th percentile {int(q[-1])}",
        f"- by words: {hist}",
        "",
        "| source | documents | words min / median / max |",
        "| --- | --- | --- |",
    ]
    for key in SOURCES:
        ls = [words(d["text"]) for d in docs if d["source"] == key]
        lines.append(f"| {key} | {len(ls)} | {stats(ls)} |")
    lines += ["", "## Sources and licences", ""]
    for key, src in SOURCES.items():
        what, licence = LICENCES[key]
        lines += [
            f"### `{key}`",
            "",
            what,
            "",
            f"- from: {src['package'] if key == 'python-stdlib' else 'Debian package ' + src['package'] + ' ' + src['version'] + debian_release()}, "
            f"file(s) `{src['path']}`",
            f"- licence: {licence}",
            "",
        ]
    lines += [
        "## bad_rows.jsonl",
        "",
        "Each line is one case for the input-validation tests. The file is not valid "
        "UTF-8 as a whole (one line holds raw bytes), so read it in binary and decode "
        "line by line. Three good rows (`bad-ok-*`, copies of real documents) are mixed "
        "in to check that valid rows still run.",
        "",
        "| line | id | case |",
        "| --- | --- | --- |",
    ]
    for n, (id_, what) in enumerate(bad_cases, 1):
        lines.append(f"| {n} | `{id_}` | {what} |")
    lines.append("")
    with open(os.path.join(HERE, "README.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


def main() -> None:
    try:
        docs = austen_docs() + constitution_docs() + pydoc_docs() + stdlib_docs()
        for n, d in enumerate(docs, 1):
            d["text"] = d["text"].strip()
            assert MIN_WORDS <= words(d["text"]) <= MAX_WORDS, (d["title"], words(d["text"]))
        docs = [dict(id=f"doc-{n:04d}", **d) for n, d in enumerate(docs, 1)]
        write_documents(docs)
        bad = write_bad_rows(docs)
        full = write_broken_parquet(docs)
        write_licences()
        write_readme(docs, bad, full)
    finally:
        if _TMP:
            shutil.rmtree(_TMP, ignore_errors=True)
    print(f"{len(docs)} documents written to {HERE}")


if __name__ == "__main__":
    main()
