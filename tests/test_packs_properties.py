"""Property: for any sequence of commits, conversions, prunes, gc and corruptions, every kept
epoch either rebuilds to exactly the bytes committed or verify reports it corrupt, and only the
epochs a corruption reached are reported: gc never removes what a kept epoch needs."""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from helpers import examples

from revenant.agent.storage import chain, packs
from revenant.agent.storage.epochs import MANIFEST, CorruptEpoch, JobFiles, Manifest, NoEpoch

pytestmark = pytest.mark.unit

PAGE = chain.PAGE

commits = st.tuples(st.just("commit"), st.floats(0, 1), st.booleans(), st.integers(0, 2**32))
converts = st.tuples(st.just("convert"), st.integers(0, 50))
ops = st.one_of(  # commits and conversions twice as often as the rest: chains worth checking
    commits, commits, converts, converts,
    st.tuples(st.just("prune"), st.integers(1, 3)),
    st.tuples(st.just("gc")),
    st.tuples(st.just("corrupt"), st.sampled_from(["pack", "plain", "idx", "recipe", "manifest"]),
              st.integers(0, 50), st.integers(0, 2**20)),
)


class Store:
    """The job's storage, and what each kept epoch must rebuild to (``tainted``: reached by a corruption)."""

    def __init__(self, root: Path, full_every: int, rnd: random.Random) -> None:
        self.files = JobFiles(root, "p")
        self.full_every = full_every
        self.rnd = rnd
        self.body = [rnd.randbytes(PAGE) for _ in range(rnd.randint(1, 12))]
        self.expected: dict[int, dict[str, bytes]] = {}
        self.tainted: set[int] = set()
        self.flipped: set[tuple[Path, int]] = set()  # a second flip of a byte would mend it

    def commit(self, dirty: float, insert: bool, seed: int) -> None:
        rnd = random.Random(seed)
        for i in range(len(self.body)):
            if rnd.random() < dirty:  # a fresh page, a zero page, or a copy of another one
                self.body[i] = rnd.choice([rnd.randbytes(PAGE), bytes(PAGE), rnd.choice(self.body)])
        if insert:
            self.body.insert(rnd.randrange(len(self.body) + 1), rnd.randbytes(PAGE))
        images = {"pages-1.img": b"".join(self.body), "pages-2.img": bytes(rnd.randrange(3) * PAGE) + b"tail",
                  "core-1.img": b"core"}
        tmp = self.files.new_tmp("n1")
        for name, data in images.items():
            (tmp / name).write_bytes(data)
        m = Manifest(job="p", epoch=0, generation=1, node="n1", created_at=time.time(), criu_version="4", kernel="k")
        self.expected[self.files.commit(tmp, m).epoch] = images

    def manifest(self, n: int) -> Manifest | None:
        try:
            return self.files.read_manifest(n)
        except CorruptEpoch:
            return None

    def pick(self, i: int, which) -> int | None:
        """The ``i``-th (modulo) kept epoch whose manifest ``which`` accepts (None: unreadable)."""
        kept = [n for n in self.files.committed() if which(self.manifest(n))]
        return kept[i % len(kept)] if kept else None

    def reads(self, n: int, ref: str, offset: int, page: bool = False) -> bool:
        """Whether epoch ``n`` reads byte ``offset`` of pack ``ref`` (not the padding of a last page,
        unless ``page``: the page it is in)."""
        m = self.manifest(n)
        for name, entry in m.recipes.items():
            at = 0  # the image's page a run starts at
            for r, first, count in chain.runs_of(chain.read_recipe(self.files, m, name)):
                if r == ref and first <= offset // PAGE < first + count:
                    if page or (at + offset // PAGE - first) * PAGE + offset % PAGE < entry.size:
                        return True
                at += count
        return False

    def corrupt(self, kind: str, i: int, offset: int) -> None:
        """Flip a byte of a pack, an index, a plain image or a recipe, or cut a manifest short."""
        f = self.files
        readable = lambda m: m is not None and m.epoch not in self.tainted  # noqa: E731
        victims: set[int] = set()
        if kind in ("pack", "idx"):
            refs = sorted({r for n in f.committed() if (m := self.manifest(n)) is not None for r in m.packs})
            if not refs:
                return
            ref = refs[i % len(refs)]
            path = chain.pack_path(f, ref, "." + kind)
            offset %= path.stat().st_size
            if kind == "pack":  # every kept epoch that reads that byte (an index only helps dedup)
                victims = {n for n in f.committed() if n not in self.tainted and self.reads(n, ref, offset)}
            else:  # the pack is hashed again: a page whose padding was flipped no longer has its digest
                pack = chain.pack_path(f, ref)
                victims = {n for n in f.committed() if n not in self.tainted
                           for p, at in self.flipped if p == pack and self.reads(n, ref, at, page=True)}
        else:
            n = self.pick(i, lambda m: readable(m) and (packs.converted(m) == (kind == "recipe") or kind == "manifest"))
            if n is None:
                return
            victims = {n}
            if kind == "plain":  # and the older epochs that read that page of it (content recipes)
                size = (f.epoch_dir(n) / "pages-1.img").stat().st_size
                victims |= {k for k in f.committed() if k < n and k not in self.tainted
                            and self.reads(k, f"@{n}/pages-1.img", offset % size)}
            if kind == "manifest":  # cut short: it no longer decodes
                path = f.epoch_dir(n) / MANIFEST
                path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
                self.tainted |= victims
                return
            m = f.read_manifest(n)
            path = f.epoch_dir(n) / (m.recipes["pages-1.img"].recipe if kind == "recipe" else "pages-1.img")
            offset %= path.stat().st_size
        if (path, offset) in self.flipped:
            return
        self.flipped.add((path, offset))
        self.tainted |= victims
        data = bytearray(path.read_bytes())
        data[offset] ^= 0xFF
        path.write_bytes(bytes(data))

    def check(self) -> None:
        f = self.files
        assert f.committed() == sorted(self.expected)
        for n, want in self.expected.items():
            if n in self.tainted:  # reported corrupt, or (another place now holds what it lost) exact
                try:
                    m = f.verify(n)
                except CorruptEpoch:
                    continue
                self.tainted.discard(n)  # healed: checked exact below, and good from now on
            else:
                m = f.verify(n)  # an untouched epoch always verifies: nothing it needs is gone
            d = f.epoch_dir(n)
            if packs.converted(m):  # rebuilt where a restore would: epochs/.tmp-<node>-<rnd>/
                d = f.new_tmp("n1")
                packs.materialize(f, m, d)
            assert {name: (d / name).read_bytes() for name in want} == want
            if d != f.epoch_dir(n):
                f.discard(d)
        good = [n for n in self.expected if n not in self.tainted]
        if good:
            assert f.newest_verified()[0].epoch == max(good)
        elif self.expected:
            with pytest.raises(NoEpoch):
                f.newest_verified()


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(full_every=st.integers(1, 4), seed=st.integers(0, 2**32), steps=st.lists(ops, max_size=14))
def test_every_kept_epoch_rebuilds_exactly_or_is_reported_corrupt(full_every, seed, steps):
    with tempfile.TemporaryDirectory() as root:
        store = Store(Path(root) / "storage", full_every, random.Random(seed))
        store.commit(0, False, seed)
        for op in steps:
            kind, args = op[0], op[1:]
            if kind == "commit":
                store.commit(*args)
            elif kind == "convert" and (n := store.pick(args[0], lambda m: True)) is not None:
                r = packs.convert(store.files, n, full_every)
                # A conversion never turns a good epoch bad: it converts, or leaves it as it was.
                assert r.converted or r.note
                event(f"convert: {'converted' if r.converted else r.note.split(':')[0].split(' ')[0]}")
            elif kind == "prune":
                for n in store.files.prune(args[0]):
                    del store.expected[n]
                    store.tainted.discard(n)
            elif kind == "gc":
                packs.gc(store.files)
            elif kind == "corrupt":
                store.corrupt(*args)
            store.check()
        event(f"kept {len(store.expected)}, of them corrupt {len(store.tainted)}")
        packs.gc(store.files)
        store.check()
        storage, own = packs.usage(store.files)
        assert set(own) <= set(store.expected) and sum(own.values()) <= storage
        assert store.files.purge() >= storage and not store.files.packs_dir.exists()
