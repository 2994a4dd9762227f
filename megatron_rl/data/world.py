"""A deterministic generated "web" for the embedded default and tests.

`generate_world(num_docs, seed)` makes countries, cities, universities, companies and people
with attributes and links (a company's founder and headquarters, a person's birthplace and
university, a city's country, a country's capital), renders one wiki-style page per entity as
(url, title, text), and derives multi-hop questions whose answers follow the links, e.g.
"In which city was the founder of Zorvex Dynamics born?". Every answer is on a page reachable
by search + visit, and each question lists its supporting pages in hop order and the
intermediate entities it passes through (`facts`).

Entities are generated up front (small named tuples; ~1M docs fit in memory); page text is
rendered on demand from a per-page seed, so `pages()` is cheap to iterate and identical across
runs. `python -m megatron_rl.data.world --docs 10000 --out corpus.parquet` writes a corpus.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

BASE_URL = "https://en.worldwiki.test/wiki/"

_SYL = ("ka", "lo", "mir", "tan", "vel", "dor", "ssa", "ri", "bel", "an", "zor", "vex", "qui",
        "len", "mar", "to", "sil", "pra", "hun", "dal", "ne", "or", "cas", "fen", "gro", "is",
        "jal", "ku", "lim", "nor", "pe", "ras", "sen", "tul", "um", "var", "wy", "xi", "yor",
        "zen", "bra", "cor", "el", "fi", "gan", "hol", "ith", "jun", "kel", "lu", "mon", "nyx",
        "ost", "pim", "rho", "sta", "thu", "ur", "vo", "wen")
_CITY_SUFFIX = ("ton", "burg", "ville", "port", "ford", "haven", "stad", "grad", "mouth", "field")
_COUNTRY_SUFFIX = ("ia", "land", "stan", "ova", "ar", "mark", "ene")
_REGIONS = ("the northern continent", "the southern continent", "the eastern archipelago",
            "the western plains", "the central highlands")
_INDUSTRIES = ("software", "shipping", "biotechnology", "mining", "aerospace", "textiles",
               "energy", "publishing", "robotics", "agriculture", "telecommunications", "finance")
_COMPANY_SUFFIX = ("Dynamics", "Systems", "Holdings", "Labs", "Industries", "Works", "Group",
                   "Partners", "Logistics", "Networks")
_OCCUPATIONS = ("engineer", "physicist", "novelist", "architect", "economist", "chemist",
                "entrepreneur", "painter", "historian", "mathematician", "surgeon", "composer")
_UNI_KIND = ("University", "Institute of Technology", "College", "Polytechnic")
_FILLER = (
    "The {x} has been described in several regional surveys.",
    "Records from {y} mention the {x} in connection with local trade.",
    "Historians disagree about the early history of the {x}.",
    "A museum exhibition in {y} featured the {x} and its archives.",
    "Local newspapers covered the {x} extensively during the {y} period.",
    "Several photographs of the {x} are held in public collections.",
)


class Country(NamedTuple):
    name: str
    capital: int  # city index
    region: str
    population: int


class City(NamedTuple):
    name: str
    country: int
    population: int
    founded: int


class University(NamedTuple):
    name: str
    city: int
    founded: int


class Company(NamedTuple):
    name: str
    founder: int  # person index
    founded: int
    hq: int  # city index
    industry: str


class Person(NamedTuple):
    name: str
    birth_city: int
    birth_year: int
    occupation: str
    university: int


# -- typed relations, aliases, attributes --------------------------------------------------------

KINDS = ("country", "city", "university", "company", "person")


class Relation(NamedTuple):
    src: str        # kind of the subject
    dst: str        # kind of the object
    inverse: str    # the relation read backwards
    functional: bool  # at most one object per subject


# forward relations are stored on the entities; each inverse is derived (one-to-many mostly)
RELATIONS: dict[str, Relation] = {
    "capital": Relation("country", "city", "capital_of", True),
    "capital_of": Relation("city", "country", "capital", True),
    "located_in": Relation("city", "country", "has_city", True),
    "has_city": Relation("country", "city", "located_in", False),
    "campus_in": Relation("university", "city", "has_university", True),
    "has_university": Relation("city", "university", "campus_in", False),
    "headquartered_in": Relation("company", "city", "headquarters_of", True),
    "headquarters_of": Relation("city", "company", "headquartered_in", False),
    "founded_by": Relation("company", "person", "founder_of", True),
    "founder_of": Relation("person", "company", "founded_by", False),
    "born_in": Relation("person", "city", "birthplace_of", True),
    "birthplace_of": Relation("city", "person", "born_in", False),
    "studied_at": Relation("person", "university", "alumnus", True),
    "alumnus": Relation("university", "person", "studied_at", False),
}
FORWARD = ("capital", "located_in", "campus_in", "headquartered_in", "founded_by",
           "born_in", "studied_at")
# the literal attributes an entity can be described by (never a name)
ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "country": ("region",), "city": ("founded",), "university": ("founded", "type"),
    "company": ("founded", "industry"), "person": ("birth_year", "occupation"),
}
NOTABLE = 3  # people / companies / alumni a city or university page lists (its out-links)


def aliases_of(kind: str, name: str) -> tuple[str, ...]:
    """Other names an entity goes by, a pure function of (kind, name): no state, no memory."""
    words = name.split()
    if kind == "person":
        return (f"{words[0][0]}. {words[-1]}", words[-1])
    if kind == "company":
        return (words[0], words[0][:4].upper())
    if kind == "city":
        return (f"{name} City",)
    if kind == "country":
        return (f"Republic of {name}", name[:3].upper())
    acronym = "".join(w[0] for w in words if w[0].isupper())
    return (acronym,) if len(acronym) > 1 else ()


@dataclass(frozen=True)
class Question:
    question: str
    answer: str
    kind: str
    support: tuple[str, ...]  # URLs of the pages that hold each hop, in order
    # the intermediate (bridge) entities the hops pass through, in hop order, the answer
    # excluded: the titles of support[1:] (the intermediate-fact reward looks for them)
    facts: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["support"] = list(self.support)
        d["facts"] = list(self.facts)
        return d


def _uni_type(name: str) -> str:
    return next(k for k in _UNI_KIND if k in name).lower()


def _word(rng: random.Random, lo: int, hi: int) -> str:
    return "".join(rng.choice(_SYL) for _ in range(rng.randint(lo, hi))).capitalize()


def _unique(rng: random.Random, seen: set[str], make: Any) -> str:
    while True:
        name = make(rng)
        if name not in seen:
            seen.add(name)
            return name


@dataclass
class World:
    seed: int
    countries: list[Country]
    cities: list[City]
    universities: list[University]
    companies: list[Company]
    people: list[Person]
    # derived lookups, built on first use (pages() needs only the small inverse maps)
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    def __len__(self) -> int:
        return (len(self.countries) + len(self.cities) + len(self.universities)
                + len(self.companies) + len(self.people))

    # -- entity ids: one int per entity, in page order (countries, cities, ..., people) ---------

    def _lists(self) -> tuple[list[Any], ...]:
        return (self.countries, self.cities, self.universities, self.companies, self.people)

    @property
    def offsets(self) -> dict[str, int]:
        if "offsets" not in self._cache:
            out, n = {}, 0
            for kind, items in zip(KINDS, self._lists()):
                out[kind] = n
                n += len(items)
            self._cache["offsets"] = out
        return self._cache["offsets"]

    def eid(self, kind: str, i: int) -> int:
        return self.offsets[kind] + i

    def ids(self, kind: str) -> range:
        start = self.offsets[kind]
        return range(start, start + len(self._lists()[KINDS.index(kind)]))

    def locate(self, eid: int) -> tuple[str, int]:
        """(kind, index within its kind) of an entity id."""
        if not 0 <= eid < len(self):
            raise IndexError(f"entity id {eid}: the world has {len(self)} entities")
        off = self.offsets
        for kind in reversed(KINDS):
            if eid >= off[kind]:
                return kind, eid - off[kind]
        raise AssertionError("unreachable")

    def kind(self, eid: int) -> str:
        return self.locate(eid)[0]

    def entity(self, eid: int) -> Any:
        kind, i = self.locate(eid)
        return self._lists()[KINDS.index(kind)][i]

    def name(self, eid: int) -> str:
        return self.entity(eid).name

    def aliases(self, eid: int) -> tuple[str, ...]:
        kind, i = self.locate(eid)
        return aliases_of(kind, self._lists()[KINDS.index(kind)][i].name)

    def names(self, eid: int) -> tuple[str, ...]:
        """The name, then the aliases."""
        return (self.name(eid), *self.aliases(eid))

    def attrs(self, eid: int) -> dict[str, Any]:
        kind, e = self.kind(eid), self.entity(eid)
        if kind == "country":
            return {"region": e.region}
        if kind == "city":
            return {"founded": e.founded}
        if kind == "university":
            return {"founded": e.founded, "type": _uni_type(e.name)}
        if kind == "company":
            return {"founded": e.founded, "industry": e.industry}
        return {"birth_year": e.birth_year, "occupation": e.occupation}

    def url(self, name: str) -> str:
        # the title as it is, spaces included (a wiki's address bar shows it so): with `data
        # tokenizer --title-tokens` a URL is the prefix's ids and the title's one id, so a name
        # is one id in a query, a note and a URL alike, and no URL needs an id of its own
        # (16,000 pages: 18k ids instead of 34k; the output layer is most of the flops)
        return BASE_URL + name

    def url_of(self, eid: int) -> str:
        return self.url(self.name(eid))

    def by_url(self, url: str) -> int | None:
        """The entity whose page is at `url` (built once: a dict of every URL)."""
        if "by_url" not in self._cache:
            self._cache["by_url"] = {self.url(e.name): n for n, e in
                                     enumerate(e for items in self._lists() for e in items)}
        return self._cache["by_url"].get(url)

    # -- typed relations ----------------------------------------------------------------------

    def forward(self, eid: int) -> list[tuple[str, int]]:
        """The stored (relation, object) edges of an entity: all functional."""
        kind, i = self.locate(eid)
        e, off = self.entity(eid), self.offsets
        if kind == "country":
            return [("capital", off["city"] + e.capital)]
        if kind == "city":
            out = [("located_in", off["country"] + e.country)]
            if self.countries[e.country].capital == i:
                out.append(("capital_of", off["country"] + e.country))
            return out
        if kind == "university":
            return [("campus_in", off["city"] + e.city)]
        if kind == "company":
            return [("founded_by", off["person"] + e.founder),
                    ("headquartered_in", off["city"] + e.hq)]
        return [("born_in", off["city"] + e.birth_city),
                ("studied_at", off["university"] + e.university)]

    def relations(self) -> Iterator[tuple[int, str, int]]:
        """Every forward (subject, relation, object) triple: the entity graph's edges (each
        also readable backwards as `RELATIONS[r].inverse`)."""
        for eid in range(len(self)):
            for rel, dst in self.forward(eid):
                if rel in FORWARD:
                    yield eid, rel, dst

    def _inverse(self) -> dict[int, list[tuple[str, int]]]:
        if "inverse" not in self._cache:
            inv: dict[int, list[tuple[str, int]]] = {}
            for src, rel, dst in self.relations():
                if rel != "capital":  # capital's inverse (capital_of) is stored on the city
                    inv.setdefault(dst, []).append((RELATIONS[rel].inverse, src))
            self._cache["inverse"] = inv
        return self._cache["inverse"]

    def neighbors(self, eid: int) -> list[tuple[str, int]]:
        """Every (relation, entity) edge leaving `eid`, inverse relations included."""
        return self.forward(eid) + self._inverse().get(eid, [])

    def objects(self, eid: int, rel: str) -> list[int]:
        return [d for r, d in self.neighbors(eid) if r == rel]

    def with_attr(self, kind: str, attr: str, value: Any) -> list[int]:
        """Entities of `kind` whose `attr` equals `value` (an index built once per attr)."""
        key = ("attr", kind, attr)
        if key not in self._cache:
            index: dict[Any, list[int]] = {}
            for eid in self.ids(kind):
                index.setdefault(self.attrs(eid)[attr], []).append(eid)
            self._cache[key] = index
        return self._cache[key].get(value, [])

    # -- pages ------------------------------------------------------------------------------------

    def _by(self, key: str) -> dict[int, list[int]]:
        """Small inverse maps for rendering: city → people born there, etc. (index lists)."""
        if key not in self._cache:
            out: dict[int, list[int]] = {}
            pairs = {"founded_by": ((c.founder, i) for i, c in enumerate(self.companies)),
                     "unis_in": ((u.city, i) for i, u in enumerate(self.universities)),
                     "born_in": ((p.birth_city, i) for i, p in enumerate(self.people)),
                     "hq_in": ((c.hq, i) for i, c in enumerate(self.companies)),
                     "alumni": ((p.university, i) for i, p in enumerate(self.people))}[key]
            for k, i in pairs:
                out.setdefault(k, []).append(i)
            self._cache[key] = out
        return self._cache[key]

    def pages(self) -> Iterator[dict[str, Any]]:
        """One {url, title, text, links} per entity, in a fixed order; `links` are the URLs of
        the entities the page mentions (its out-links), also listed at the end of the text."""
        n = 0
        for kind, items in zip(KINDS, self._lists()):
            render = getattr(self, f"_render_{kind}")
            for i, e in enumerate(items):
                rng = random.Random(self.seed * 1_000_003 + n)
                n += 1
                body, links = render(i, e, rng)
                text, urls = self._finish(kind, e.name, body, links, rng)
                yield {"url": self.url(e.name), "title": e.name, "text": text, "links": urls}

    def _finish(self, kind: str, name: str, body: list[str], links: list[str],
                rng: random.Random) -> tuple[str, list[str]]:
        aka = aliases_of(kind, name)
        if aka:
            body[0] += f" Also known as {' or '.join(aka)}."
        # filler mentions random other entities, so BM25 has distractors for every name
        others = [rng.choice(self.cities).name, rng.choice(self.companies).name]
        filler = " ".join(t.format(x=rng.choice(("subject", "topic", "entry")) + " " + name,
                                   y=rng.choice(others))
                          for t in rng.sample(_FILLER, 2))
        related = list(dict.fromkeys(links))
        urls = [self.url(r) for r in related]
        # hyperlinks as a wiki renders them: anchor text and target
        see = "; ".join(f"{r} <{u}>" for r, u in zip(related, urls))
        return "\n\n".join([*body, filler, f"See also: {see}."]), urls

    def _render_country(self, i: int, c: Country, rng: random.Random) -> tuple:
        capital = self.cities[c.capital].name
        body = [f"{c.name} is a country in {c.region}. Its capital and largest city is "
                f"{capital}. The country has a population of about {c.population:,} people.",
                f"The government of {c.name} sits in {capital}."]
        return body, [capital]

    def _render_city(self, i: int, c: City, rng: random.Random) -> tuple:
        country = self.countries[c.country].name
        body = [f"{c.name} is a city in {country}, founded in {c.founded}. It has a population "
                f"of {c.population:,}."]
        links = [country]
        unis = [self.universities[u].name for u in self._by("unis_in").get(i, [])]
        if unis:
            body.append(f"{c.name} is home to {', '.join(unis)}.")
            links += unis
        if self.countries[c.country].capital == i:
            body.append(f"{c.name} is the capital of {country}.")
        people = [self.people[p].name for p in self._by("born_in").get(i, [])[:NOTABLE]]
        if people:
            body.append(f"Notable people born in {c.name} include {', '.join(people)}.")
            links += people
        firms = [self.companies[k].name for k in self._by("hq_in").get(i, [])[:NOTABLE]]
        if firms:
            body.append(f"Companies based in {c.name} include {', '.join(firms)}.")
            links += firms
        return body, links

    def _render_university(self, i: int, u: University, rng: random.Random) -> tuple:
        city = self.cities[u.city]
        country = self.countries[city.country].name
        body = [f"{u.name} is a public university located in {city.name}, {country}. It was "
                f"founded in {u.founded}.",
                f"{u.name} is known for its research in {rng.choice(_INDUSTRIES)}."]
        links = [city.name]
        alumni = [self.people[p].name for p in self._by("alumni").get(i, [])[:NOTABLE]]
        if alumni:
            body.append(f"Alumni of {u.name} include {', '.join(alumni)}.")
            links += alumni
        return body, links

    def _render_company(self, i: int, c: Company, rng: random.Random) -> tuple:
        founder = self.people[c.founder].name
        hq = self.cities[c.hq]
        country = self.countries[hq.country].name
        body = [f"{c.name} is a {c.industry} company headquartered in {hq.name}, {country}.",
                f"{c.name} was founded in {c.founded} by {founder}. The founder of {c.name}, "
                f"{founder}, led the company during its first years."]
        return body, [founder, hq.name]

    def _render_person(self, i: int, p: Person, rng: random.Random) -> tuple:
        city = self.cities[p.birth_city].name
        uni = self.universities[p.university].name
        body = [f"{p.name} (born {p.birth_year}) is a {p.occupation}. {p.name} was born in "
                f"{city}.",
                f"{p.name} studied at {uni}."]
        links = [city, uni]
        companies = [self.companies[c].name for c in self._by("founded_by").get(i, [])]
        if companies:
            body.append(f"{p.name} is the founder of {', '.join(companies)}.")
            links += companies
        return body, links

    # -- questions --------------------------------------------------------------------------------

    def questions(self, n: int, seed: int | None = None) -> list[Question]:
        """`n` multi-hop questions (2 and 3 hops), deterministic in (world, seed)."""
        rng = random.Random(self.seed if seed is None else seed)
        makers = (self._q_founder_birth_city, self._q_company_country, self._q_founder_university,
                  self._q_university_year, self._q_birth_country_capital,
                  self._q_founder_university_city)
        return [makers[k % len(makers)](rng) for k in range(n)]

    def _q_founder_birth_city(self, rng: random.Random) -> Question:
        c = rng.choice(self.companies)
        p = self.people[c.founder]
        return Question(f"In which city was the founder of {c.name} born?",
                        self.cities[p.birth_city].name, "founder_birth_city",
                        (self.url(c.name), self.url(p.name)), (p.name,))

    def _q_company_country(self, rng: random.Random) -> Question:
        c = rng.choice(self.companies)
        city = self.cities[c.hq]
        return Question(f"In which country is the headquarters of {c.name}?",
                        self.countries[city.country].name, "company_country",
                        (self.url(c.name), self.url(city.name)), (city.name,))

    def _q_founder_university(self, rng: random.Random) -> Question:
        c = rng.choice(self.companies)
        p = self.people[c.founder]
        return Question(f"Which university did the founder of {c.name} attend?",
                        self.universities[p.university].name, "founder_university",
                        (self.url(c.name), self.url(p.name)), (p.name,))

    def _q_university_year(self, rng: random.Random) -> Question:
        p = rng.choice(self.people)
        u = self.universities[p.university]
        return Question(f"In what year was the university attended by {p.name} founded?",
                        str(u.founded), "university_year", (self.url(p.name), self.url(u.name)),
                        (u.name,))

    def _q_birth_country_capital(self, rng: random.Random) -> Question:
        p = rng.choice(self.people)
        city = self.cities[p.birth_city]
        country = self.countries[city.country]
        return Question(f"What is the capital of the country where {p.name} was born?",
                        self.cities[country.capital].name, "birth_country_capital",
                        (self.url(p.name), self.url(city.name), self.url(country.name)),
                        (city.name, country.name))

    def _q_founder_university_city(self, rng: random.Random) -> Question:
        c = rng.choice(self.companies)
        p = self.people[c.founder]
        u = self.universities[p.university]
        return Question(f"In which city is the university attended by the founder of {c.name} "
                        "located?", self.cities[u.city].name, "founder_university_city",
                        (self.url(c.name), self.url(p.name), self.url(u.name)),
                        (p.name, u.name))


def generate_world(num_docs: int = 10_000, seed: int = 0) -> World:
    """Exactly `num_docs` pages (at least 30): ~0.5% countries, 8% cities, 2.5% universities,
    20% companies, the rest people."""
    if num_docs < 30:
        raise ValueError(f"num_docs={num_docs}: a world needs at least 30 pages")
    rng = random.Random(seed)
    n_country = max(3, num_docs // 200)
    n_city = max(6, num_docs // 12)
    n_uni = max(3, num_docs // 40)
    n_company = max(5, num_docs // 5)
    n_person = num_docs - n_country - n_city - n_uni - n_company
    seen: set[str] = set()  # names are unique across kinds: one page per name
    country_names = [_unique(rng, seen, lambda r: _word(r, 1, 2) + r.choice(_COUNTRY_SUFFIX))
                     for _ in range(n_country)]
    cities = []
    for i in range(n_city):
        # the first cities are the capitals, one per country; the rest land anywhere
        country = i if i < n_country else rng.randrange(n_country)
        name = _unique(rng, seen, lambda r: _word(r, 1, 3) + r.choice(_CITY_SUFFIX))
        cities.append(City(name, country, rng.randint(5_000, 3_000_000), rng.randint(800, 1900)))
    countries = [Country(name, i, rng.choice(_REGIONS), rng.randint(300_000, 90_000_000))
                 for i, name in enumerate(country_names)]
    universities = []
    for _ in range(n_uni):
        city = rng.randrange(n_city)
        kind = rng.choice(_UNI_KIND)
        name = _unique(rng, seen, lambda r, c=city, k=kind: f"{k} of {cities[c].name}"
                       if r.random() < 0.5 else f"{_word(r, 2, 3)} {k}")
        universities.append(University(name, city, rng.randint(1100, 1990)))
    people = []
    for _ in range(n_person):
        name = _unique(rng, seen, lambda r: f"{_word(r, 2, 2)} {_word(r, 2, 3)}")
        birth_year = rng.randint(1900, 2000)
        people.append(Person(name, rng.randrange(n_city), birth_year,
                             rng.choice(_OCCUPATIONS), rng.randrange(n_uni)))
    companies = []
    for _ in range(n_company):
        name = _unique(rng, seen, lambda r: f"{_word(r, 2, 3)} {r.choice(_COMPANY_SUFFIX)}")
        founder = rng.randrange(n_person)
        companies.append(Company(name, founder, people[founder].birth_year + rng.randint(22, 60),
                                 rng.randrange(n_city), rng.choice(_INDUSTRIES)))
    return World(seed, countries, cities, universities, companies, people)


def write_corpus(world: World, path: str | Path, batch_rows: int = 20_000) -> int:
    """Write the pages as .parquet (url, title, text, links) or .jsonl. Returns the row
    count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pa.schema([("url", pa.string()), ("title", pa.string()), ("text", pa.string()),
                            ("links", pa.list_(pa.string()))])
        with pq.ParquetWriter(path, schema) as w:
            batch: list[dict[str, str]] = []
            for page in world.pages():
                batch.append(page)
                if len(batch) == batch_rows:
                    w.write_table(pa.Table.from_pylist(batch, schema))
                    n += len(batch)
                    batch = []
            if batch:
                w.write_table(pa.Table.from_pylist(batch, schema))
                n += len(batch)
        return n
    if path.suffix in (".jsonl", ".json"):
        with open(path, "w", encoding="utf-8") as f:
            for page in world.pages():
                f.write(json.dumps(page, ensure_ascii=False) + "\n")
                n += 1
        return n
    raise ValueError(f"{path}: write .parquet or .jsonl")


def build_world_index(world: World, folder: str | Path, fmt: str = "parquet") -> Path:
    """Write the pages to `folder/corpus.<fmt>` and index them into `folder/index` (returned)."""
    from megatron_rl.env.index import build_index

    folder = Path(folder)
    write_corpus(world, folder / f"corpus.{fmt}")
    build_index(folder / f"corpus.{fmt}", folder / "index", progress=False)
    return folder / "index"


def _world_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pages", "--docs", dest="pages", type=int, default=10_000,
                   help="pages (entities) of the world")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="corpus .parquet or .jsonl")
    p.add_argument("--graph", help="also write the typed relations (subject, relation, object "
                   "names) to this .jsonl")
    p.add_argument("--index", help="also build a search index into this folder")
    p.add_argument("--questions", help="also write N verbatim questions to this .jsonl")
    p.add_argument("--num-questions", type=int, default=100)


def run_world(a: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    world = generate_world(a.pages, a.seed)
    n = write_corpus(world, a.out)
    print(f"{n} pages -> {a.out} in {time.perf_counter() - t0:.1f}s")
    if a.graph:
        m = 0
        with open(a.graph, "w", encoding="utf-8") as f:
            for src, rel, dst in world.relations():
                f.write(json.dumps({"subject": world.name(src), "relation": rel,
                                    "object": world.name(dst)}) + "\n")
                m += 1
        print(f"{m} relations -> {a.graph}")
    if a.index:
        from megatron_rl.env.index import build_index

        build_index(a.out, a.index, progress=False)
        print(f"index -> {a.index}")
    if a.questions:
        with open(a.questions, "w", encoding="utf-8") as f:
            for q in world.questions(a.num_questions):
                f.write(json.dumps(q.to_dict()) + "\n")
        print(f"{a.num_questions} questions -> {a.questions}")
    return 0


def add_world_parser(subparsers: Any) -> argparse.ArgumentParser:
    """`world`: write the generated web (pages with links, optionally relations and index)."""
    p = subparsers.add_parser("world", help="a deterministic fictional web: pages with links, "
                              "typed relations")
    _world_arguments(p)
    p.set_defaults(func=run_world)
    return p


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="write a generated corpus (and questions)")
    _world_arguments(p)
    return run_world(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
