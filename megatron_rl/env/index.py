"""The local BM25 index (tantivy) and page store built from a (url, title, text) corpus.

An index folder holds `tantivy/` (the index; title and text stemmed, url as an exact term; all
three stored, so the same folder serves `search` and `visit`) and `manifest.json` (format, id,
document count, source, build time). `build_index` writes into a temp folder beside the target
and renames it when complete, so a reader never sees a half-built index.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import tantivy

INDEX_FORMAT = 1
COLUMNS = ("url", "title", "text")
SNIPPET_CHARS = 200
TITLE_BOOST = 2.0


class CorpusError(ValueError):
    """Bad corpus input; the message names the file and the column or line."""


class IndexOpenError(RuntimeError):
    """A missing, partial or incompatible index folder."""


@dataclass(frozen=True)
class SearchHit:
    title: str
    url: str
    snippet: str
    score: float

    def to_dict(self) -> dict[str, Any]:
        return {"title": self.title, "url": self.url, "snippet": self.snippet,
                "score": self.score}


@dataclass(frozen=True)
class Page:
    url: str
    title: str
    text: str


# -- corpus input ---------------------------------------------------------------------------------

def _check_row(path: Path, where: str, row: dict[str, Any]) -> tuple[str, str, str]:
    out = []
    for col in COLUMNS:
        v = row.get(col)
        if v is None and col != "url":
            v = ""  # a page without a title or body is odd but harmless
        if not isinstance(v, str):
            raise CorpusError(f"{path}: {where}: column {col!r} must be a string, got "
                              f"{type(v).__name__}")
        out.append(v)
    if not out[0].strip():
        raise CorpusError(f"{path}: {where}: column 'url' is empty")
    return out[0].strip(), out[1], out[2]


def corpus_rows(path: str | Path) -> tuple[int | None, Iterator[tuple[str, str, str]]]:
    """(row count if known, iterator of (url, title, text)) from .parquet or .jsonl/.json."""
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"{path}: no such corpus file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
        except Exception as e:
            raise CorpusError(f"{path}: not a readable parquet file: {e}") from None
        names = pf.schema_arrow.names
        missing = [c for c in COLUMNS if c not in names]
        if missing:
            raise CorpusError(f"{path}: missing column(s) {missing}; found {names} (a corpus "
                              "needs url, title, text)")

        def parquet_rows() -> Iterator[tuple[str, str, str]]:
            i = 0
            for batch in pf.iter_batches(batch_size=4096, columns=list(COLUMNS)):
                cols = [batch.column(c).to_pylist() for c in COLUMNS]
                for url, title, text in zip(*cols):
                    yield _check_row(path, f"row {i}", {"url": url, "title": title,
                                                         "text": text})
                    i += 1

        return pf.metadata.num_rows, parquet_rows()
    if path.suffix in (".jsonl", ".json", ".ndjson"):
        def jsonl_rows() -> Iterator[tuple[str, str, str]]:
            with open(path, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise CorpusError(f"{path}: line {lineno}: not JSON: {e}") from None
                    if not isinstance(row, dict):
                        raise CorpusError(f"{path}: line {lineno}: expected an object with "
                                          f"{list(COLUMNS)}")
                    missing = [c for c in COLUMNS if c not in row]
                    if missing:
                        raise CorpusError(f"{path}: line {lineno}: missing column(s) {missing}")
                    yield _check_row(path, f"line {lineno}", row)

        return None, jsonl_rows()
    raise CorpusError(f"{path}: unknown corpus format {path.suffix!r} (use .parquet or .jsonl)")


# -- build ----------------------------------------------------------------------------------------

def _schema() -> tantivy.Schema:
    sb = tantivy.SchemaBuilder()
    sb.add_text_field("url", stored=True, tokenizer_name="raw")
    sb.add_text_field("title", stored=True, tokenizer_name="en_stem")
    sb.add_text_field("text", stored=True, tokenizer_name="en_stem")
    return sb.build()


def build_index(corpus: str | Path, out: str | Path, *, overwrite: bool = False,
                progress: bool = True, heap_mb: int = 256, threads: int = 0) -> dict[str, Any]:
    """Index `corpus` into the folder `out` (atomically). Returns the manifest.

    Rows with a URL seen before are skipped (counted in `duplicates_skipped`): a page store
    needs one page per URL."""
    from tqdm import tqdm

    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists (pass overwrite=True / --overwrite to replace it)")
    total, rows = corpus_rows(corpus)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{uuid.uuid4().hex[:8]}"
    t0 = time.perf_counter()
    index = writer = None
    try:
        (tmp / "tantivy").mkdir(parents=True)
        index = tantivy.Index(_schema(), path=str(tmp / "tantivy"))
        writer = index.writer(heap_size=heap_mb * 1_000_000, num_threads=threads)
        seen: set[str] = set()
        dupes = 0
        for url, title, text in tqdm(rows, total=total, unit="doc", disable=not progress,
                                     desc=f"indexing {Path(corpus).name}", mininterval=1.0):
            if url in seen:
                dupes += 1
                continue
            seen.add(url)
            doc = tantivy.Document()
            doc.add_text("url", url)
            doc.add_text("title", title)
            doc.add_text("text", text)
            writer.add_document(doc)
        writer.commit()
        writer.wait_merging_threads()
        manifest = {"format": INDEX_FORMAT, "id": uuid.uuid4().hex, "docs": len(seen),
                    "duplicates_skipped": dupes, "source": str(Path(corpus).resolve()),
                    "built_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "build_seconds": round(time.perf_counter() - t0, 3)}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        if out.exists():
            old = out.parent / f".old-{out.name}-{uuid.uuid4().hex[:8]}"
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        # the writer's threads hold files (and its lock) until it is dropped
        index = writer = None
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def folder_bytes(path: str | Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


# -- read -----------------------------------------------------------------------------------------

_QUERY_SYNTAX = re.compile(r"[^\w]+")
# dropped from queries (not from the index): they match most pages, so they cost a long
# posting-list walk each (4x the latency at 100k docs) for almost no BM25 weight
STOPWORDS = frozenset(
    "a an the of in on at to for from by with and or is are was were be been what which who whom "
    "whose when where why how did does do this that these those it its as into about than".split())
QUERY_FIELDS = (("title", TITLE_BOOST), ("text", 1.0))
# a (field, term) clause matching more than this share of pages is "common": the pruned search
# only scores it on pages that match a rarer clause (see SearchIndex._pruned)
COMMON_SHARE = 0.05
MAX_TIED_HITS = 4096  # hits fetched at most to order the k-th score's ties by URL
BM25_K1 = 1.2  # tantivy's; a clause scores below boost * idf * (1 + k1) on any page


def _en_stem() -> tantivy.TextAnalyzer:
    # the `en_stem` tokenizer the index uses (tantivy's definition), to look terms up ourselves
    return (tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.simple())
            .filter(tantivy.Filter.remove_long(40)).filter(tantivy.Filter.lowercase())
            .filter(tantivy.Filter.stemmer("english")).build())


class SearchIndex:
    """A built index folder, opened read-only. Thread-safe: one searcher over a frozen index."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        mpath = self.path / "manifest.json"
        if not mpath.is_file():
            raise IndexOpenError(f"{self.path}: not a search index (no manifest.json; build one "
                              "with `megatron-rl search build`)")
        self.manifest: dict[str, Any] = json.loads(mpath.read_text())
        if self.manifest.get("format") != INDEX_FORMAT:
            raise IndexOpenError(f"{self.path}: index format {self.manifest.get('format')} is not "
                              f"{INDEX_FORMAT}; rebuild it")
        try:
            self._index = tantivy.Index.open(str(self.path / "tantivy"))
        except Exception as e:
            raise IndexOpenError(f"{self.path}: cannot open the tantivy index: {e}") from None
        self._schema = self._index.schema
        self._searcher = self._index.searcher()
        self._analyzer = _en_stem()
        self._total = max(1, int(self._searcher.num_docs))

    @property
    def id(self) -> str:
        return str(self.manifest["id"])

    @property
    def num_docs(self) -> int:
        return int(self._searcher.num_docs)

    @staticmethod
    def _words(query: str) -> list[str]:
        # agents write natural language: drop the query language's syntax (quotes, colons,
        # brackets) and lower-case so AND/OR/NOT are words, not operators
        words = _QUERY_SYNTAX.sub(" ", query).lower().split()
        return [w for w in words if w not in STOPWORDS] or words  # "The Who" stays

    def parse(self, query: str) -> tantivy.Query | None:
        """The full query: every word, BM25 over title (boosted) and text."""
        words = self._words(query)
        return self._full(words) if words else None

    def _full(self, words: list[str]) -> tantivy.Query:
        return self._index.parse_query(" ".join(words), ["title", "text"],
                                       field_boosts={"title": TITLE_BOOST})

    def _pruned(self, words: list[str]) -> tuple[tantivy.Query, float] | None:
        """The full query's clauses as "pages matching a rare clause, scored on every clause",
        and a bound on the score of a page matching common clauses only; None where that split
        does not apply.

        tantivy-py's top-k search walks every posting of every clause (no block-max pruning),
        so common words ("born", "founder", in most pages of a 1M corpus) cost most of a
        query. Here they are only looked up on pages that match a rarer clause; each page
        keeps the score the full query gives it."""
        clauses: list[tuple[int, float, str, str]] = []  # (doc freq, boost, field, term)
        for w in dict.fromkeys(words):  # the parser drops a repeated word, not a repeated stem
            tokens = self._analyzer.analyze(w)
            if len(tokens) != 1:
                return None  # the parser makes a phrase of "foo_bar"; dropped tokens: no term
            for field, boost in QUERY_FIELDS:
                df = self._searcher.doc_freq(field, tokens[0])
                if df:  # a term no page has adds nothing
                    clauses.append((df, boost, field, tokens[0]))
        if not clauses:
            return None
        cut = max(COMMON_SHARE * self._total, min(c[0] for c in clauses))
        rare, common, bound = [], [], 0.0
        for df, boost, field, term in clauses:
            q = tantivy.Query.term_query(self._schema, field, term, index_option="freq")
            if boost != 1.0:
                q = tantivy.Query.boost_query(q, boost)
            if df <= cut:
                rare.append((tantivy.Occur.Should, q))
            else:
                common.append((tantivy.Occur.Should, q))
                idf = math.log(1 + (self._total - df + 0.5) / (df + 0.5))
                bound += boost * idf * (1 + BM25_K1)
        q = tantivy.Query.boolean_query(rare)
        # one optional clause per level: tantivy then seeks that one posting list to each
        # candidate (skip list); several optional clauses make a union that reads them whole
        for c in common:
            q = tantivy.Query.boolean_query([(tantivy.Occur.Must, q), c])
        return q, (bound * 1.001 + 1e-6) if common else 0.0  # margin: f32 sums

    def _top(self, words: list[str], top_k: int) -> tuple[tantivy.Query, list]:
        pruned = self._pruned(words)
        if pruned is not None:
            q, bound = pruned
            hits = self._ranked(q, top_k)
            # exact when no page outside the candidates can reach the k-th score; else (under
            # 1% of the benchmark's queries at 1M) run the full query
            if bound == 0.0 or (len(hits) == top_k and hits[-1][0] > bound):
                return q, hits
        q = self._full(words)
        return q, self._ranked(q, top_k)

    def _ranked(self, q: tantivy.Query, top_k: int) -> list:
        """The top `top_k` (score, address) by score, equal scores by URL. tantivy breaks ties
        by document address, which differs between two builds of the same corpus (its
        indexing threads), and BM25 ties are common (quantised field lengths): without this,
        a rebuilt index gave another second result for the same query."""
        n = top_k + 1
        while True:  # widen until the k-th score's ties all lie inside what was fetched
            hits = self._searcher.search(q, n, count=False).hits
            if len(hits) <= top_k or hits[top_k - 1][0] != hits[-1][0] or len(hits) < n:
                break
            if n >= MAX_TIED_HITS:  # a pathological tie: the build's order decides
                return hits[:top_k]
            n = min(4 * n, MAX_TIED_HITS)
        if not hits:
            return hits
        last = hits[min(top_k, len(hits)) - 1][0]
        tied = [h for h in hits if h[0] >= last]  # the fetched rest scores below `last`
        if len({score for score, _ in tied}) == len(tied):
            return tied[:top_k]
        keyed = [(-score, self._searcher.doc(addr).get_first("url") or "", i)
                 for i, (score, addr) in enumerate(tied)]
        return [tied[i] for *_, i in sorted(keyed)[:top_k]]

    def search(self, query: str, top_k: int = 10) -> list[SearchHit]:
        words = self._words(query)
        if not words:
            return []
        q, found = self._top(words, top_k)
        if not found:
            return []
        # the pruned query has the full query's terms, so its snippets are the same
        snippets = tantivy.SnippetGenerator.create(self._searcher, q, self._schema, "text")
        snippets.set_max_num_chars(SNIPPET_CHARS)
        hits = []
        for score, addr in found:
            doc = self._searcher.doc(addr)
            text = doc.get_first("text") or ""
            snippet = snippets.snippet_from_doc(doc).fragment().strip()
            if not snippet:  # matched on the title only: show the page's opening
                snippet = _opening(text, SNIPPET_CHARS)
            hits.append(SearchHit(title=doc.get_first("title") or "", url=doc.get_first("url"),
                                  snippet=" ".join(snippet.split()), score=float(score)))
        return hits

    def page(self, url: str) -> Page | None:
        u = url.strip()
        # as written first; then the spellings a wiki treats as the same page (`%20`, `_` or a
        # space between a title's words)
        plain = unquote(u)
        spaced, joined = plain.replace("_", " "), plain.replace(" ", "_")
        for candidate in dict.fromkeys([url, u, u.rstrip("/"), u + "/", spaced, joined]):
            q = tantivy.Query.term_query(self._schema, "url", candidate)
            hits = self._searcher.search(q, 1, count=False).hits
            if hits:
                doc = self._searcher.doc(hits[0][1])
                return Page(url=doc.get_first("url"), title=doc.get_first("title") or "",
                            text=doc.get_first("text") or "")
        return None


def _opening(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    cut = text[:limit].rsplit(" ", 1)[0]
    return cut + " …"
