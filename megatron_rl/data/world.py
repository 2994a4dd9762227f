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
import re
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
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


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")


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

    def __len__(self) -> int:
        return (len(self.countries) + len(self.cities) + len(self.universities)
                + len(self.companies) + len(self.people))

    # -- urls -------------------------------------------------------------------------------------

    def url(self, name: str) -> str:
        return BASE_URL + slug(name)

    def _founded_by(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for i, c in enumerate(self.companies):
            out.setdefault(c.founder, []).append(i)
        return out

    # -- pages ------------------------------------------------------------------------------------

    def pages(self) -> Iterator[dict[str, str]]:
        """One {url, title, text} per entity, in a fixed order."""
        founded_by = self._founded_by()
        unis_in: dict[int, list[int]] = {}
        for i, u in enumerate(self.universities):
            unis_in.setdefault(u.city, []).append(i)
        n = 0
        for kind, items in (("country", self.countries), ("city", self.cities),
                            ("university", self.universities), ("company", self.companies),
                            ("person", self.people)):
            for i, e in enumerate(items):
                rng = random.Random(self.seed * 1_000_003 + n)
                n += 1
                body, links = getattr(self, f"_render_{kind}")(i, e, rng, founded_by, unis_in)
                yield {"url": self.url(e.name), "title": e.name,
                       "text": self._finish(e.name, body, links, rng)}

    def _finish(self, name: str, body: list[str], links: list[str], rng: random.Random) -> str:
        # filler mentions random other entities, so BM25 has distractors for every name
        others = [rng.choice(self.cities).name, rng.choice(self.companies).name]
        filler = " ".join(t.format(x=rng.choice(("subject", "topic", "entry")) + " " + name,
                                   y=rng.choice(others))
                          for t in rng.sample(_FILLER, 2))
        # names only: a page's neighbours are found by searching for them, as on a wiki
        # without hrefs (markdown links would also put URL words into snippets)
        related = "; ".join(dict.fromkeys(links))
        return "\n\n".join([*body, filler, f"See also: {related}."])

    def _render_country(self, i: int, c: Country, rng: random.Random, *_: Any) -> tuple:
        capital = self.cities[c.capital].name
        body = [f"{c.name} is a country in {c.region}. Its capital and largest city is "
                f"{capital}. The country has a population of about {c.population:,} people.",
                f"The government of {c.name} sits in {capital}."]
        return body, [capital]

    def _render_city(self, i: int, c: City, rng: random.Random, founded_by: Any,
                     unis_in: dict[int, list[int]]) -> tuple:
        country = self.countries[c.country].name
        body = [f"{c.name} is a city in {country}, founded in {c.founded}. It has a population "
                f"of {c.population:,}."]
        links = [country]
        unis = [self.universities[u].name for u in unis_in.get(i, [])]
        if unis:
            body.append(f"{c.name} is home to {', '.join(unis)}.")
            links += unis
        if self.countries[c.country].capital == i:
            body.append(f"{c.name} is the capital of {country}.")
        return body, links

    def _render_university(self, i: int, u: University, rng: random.Random, *_: Any) -> tuple:
        city = self.cities[u.city]
        country = self.countries[city.country].name
        body = [f"{u.name} is a public university located in {city.name}, {country}. It was "
                f"founded in {u.founded}.",
                f"{u.name} is known for its research in {rng.choice(_INDUSTRIES)}."]
        return body, [city.name]

    def _render_company(self, i: int, c: Company, rng: random.Random, *_: Any) -> tuple:
        founder = self.people[c.founder].name
        hq = self.cities[c.hq]
        country = self.countries[hq.country].name
        body = [f"{c.name} is a {c.industry} company headquartered in {hq.name}, {country}.",
                f"{c.name} was founded in {c.founded} by {founder}. The founder of {c.name}, "
                f"{founder}, led the company during its first years."]
        return body, [founder, hq.name]

    def _render_person(self, i: int, p: Person, rng: random.Random,
                       founded_by: dict[int, list[int]], *_: Any) -> tuple:
        city = self.cities[p.birth_city].name
        uni = self.universities[p.university].name
        body = [f"{p.name} (born {p.birth_year}) is a {p.occupation}. {p.name} was born in "
                f"{city}.",
                f"{p.name} studied at {uni}."]
        links = [city, uni]
        companies = [self.companies[c].name for c in founded_by.get(i, [])]
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
    """Write the pages as .parquet (url, title, text) or .jsonl. Returns the row count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pa.schema([("url", pa.string()), ("title", pa.string()), ("text", pa.string())])
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="write a generated corpus (and questions)")
    p.add_argument("--docs", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="corpus .parquet or .jsonl")
    p.add_argument("--questions", help="also write N questions to this .jsonl")
    p.add_argument("--num-questions", type=int, default=100)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    world = generate_world(a.docs, a.seed)
    n = write_corpus(world, a.out)
    print(f"{n} pages -> {a.out} in {time.perf_counter() - t0:.1f}s")
    if a.questions:
        with open(a.questions, "w", encoding="utf-8") as f:
            for q in world.questions(a.num_questions):
                f.write(json.dumps(q.to_dict()) + "\n")
        print(f"{a.num_questions} questions -> {a.questions}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
