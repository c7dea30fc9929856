"""mmrl.eval.benchmarks: the shipped benchmark assets load with their documented counts, their bytes are the
upstream ones, and bad files raise DataError naming the file and line."""
import csv
import hashlib
import io
import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from mmrl.data.prompts import DataError
from mmrl.eval import benchmarks as B

ASSETS = B.assets_dir()
SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "benchmarks"

# Every shipped data/licence file and the first 8 hex digits of its git blob id, as listed in the upstream
# trees (and each folder's ATTRIBUTION.md). The DPG-Bench prompt files are checked as one manifest hash.
BLOBS = {
    "geneval/evaluation_metadata.jsonl": "efc21c7e", "geneval/generation_prompts.txt": "bde3a8a3",
    "geneval/object_names.txt": "f4822dd0", "geneval/LICENSE": "0f37bf7b",
    "t2i_compbench/License.txt": "efcbf8b2", "t2i_compbench/NOTICE.md": "883fa802",
    "t2i_compbench/dataset/color_val.txt": "700badf7", "t2i_compbench/dataset/shape_val.txt": "b82835d7",
    "t2i_compbench/dataset/texture_val.txt": "61d35c8e", "t2i_compbench/dataset/spatial_val.txt": "e453b999",
    "t2i_compbench/dataset/non_spatial_val.txt": "046d5689", "t2i_compbench/dataset/complex_val.txt": "3667f783",
    "t2i_compbench/dataset/complex_val_action.txt": "fb0f4988",
    "t2i_compbench/dataset/complex_val_spatial.txt": "19fd020b",
    "t2i_compbench/dataset/complex_val_spatialaction.txt": "7aaf748b",
    "t2i_compbench/dataset/3d_spatial_val.txt": "c799d256", "t2i_compbench/dataset/numeracy_val.txt": "f9246e9c",
    "t2i_compbench/dataset/color_val_seen.txt": "77816840", "t2i_compbench/dataset/color_val_unseen.txt": "cc6d8c93",
    "t2i_compbench/dataset/shape_val_seen.txt": "f0759536", "t2i_compbench/dataset/shape_val_unseen.txt": "f89f0007",
    "t2i_compbench/dataset/texture_val_seen.txt": "cf139714",
    "t2i_compbench/dataset/texture_val_unseen.txt": "71af48ee",
    "dpg_bench/LICENSE": "261eeb9e",
    "ocr/test.txt": "8deb4f8d", "ocr/LICENSE": "125f60c7",
    "partiprompts/PartiPrompts.tsv": "f96e7125", "partiprompts/LICENSE": "d6456956",
    "drawbench/test.txt": "8d96e7cf", "drawbench/prompts_unique.txt": "5f234669", "drawbench/LICENSE": "261eeb9e",
    "charades_sta/charades_sta_test.txt": "9268d0e7", "charades_sta/charades_test.json": "15708040",
    "charades_sta/LICENSE.2D-TAN": "8942c171", "charades_sta/LICENSE.TimeZero": "261eeb9e",
}
DPG_PROMPTS_SHA256 = "090f744aaa64391b0b6c7e80b9ff4148bbd78da00e884770005df2245cd0b159"
DOCS = {"README.md"} | {f"{d}/ATTRIBUTION.md" for d in
                        ("geneval", "t2i_compbench", "dpg_bench", "ocr", "partiprompts", "drawbench", "charades_sta")}


def git_blob(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def dpg_manifest(directory: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(directory.glob("*.txt")):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def shipped_files() -> set[str]:
    return {p.relative_to(ASSETS).as_posix() for p in ASSETS.rglob("*") if p.is_file()}


# ------------------------------------------------------------------------------------------------ the bytes

def test_shipped_files_are_the_upstream_blobs():
    files = shipped_files()
    dpg = {f for f in files if f.startswith("dpg_bench/prompts/")}
    assert files - dpg == set(BLOBS) | DOCS, "unexpected or missing files under assets/benchmarks"
    for rel, blob in BLOBS.items():
        assert git_blob(ASSETS / rel).startswith(blob), rel
    assert len(dpg) == 1065 and all(f.endswith(".txt") for f in dpg)
    assert dpg_manifest(ASSETS / "dpg_bench" / "prompts") == DPG_PROMPTS_SHA256
    total = sum((ASSETS / f).stat().st_size for f in files)
    assert total < 3_000_000, f"the shipped assets grew to {total} bytes"


@pytest.mark.skipif(not SHARED.is_dir(), reason=f"no shared benchmark collection at {SHARED}")
def test_shipped_bytes_equal_the_shared_collection():
    for rel in shipped_files() - DOCS:
        ours, theirs = ASSETS / rel, SHARED / rel
        assert theirs.is_file(), rel
        assert hashlib.sha256(ours.read_bytes()).digest() == hashlib.sha256(theirs.read_bytes()).digest(), rel
    assert dpg_manifest(SHARED / "dpg_bench" / "prompts") == DPG_PROMPTS_SHA256


def test_every_folder_has_its_licence_and_attribution():
    licences = {"geneval": ["LICENSE"], "t2i_compbench": ["License.txt"], "dpg_bench": ["LICENSE"], "ocr": ["LICENSE"],
                "partiprompts": ["LICENSE"], "drawbench": ["LICENSE"],
                "charades_sta": ["LICENSE.2D-TAN", "LICENSE.TimeZero"]}
    for folder, names in licences.items():
        attribution = (ASSETS / folder / "ATTRIBUTION.md").read_text()
        assert "ommit" in attribution and "icen" in attribution and "mmrl" in attribution, folder
        for name in names:
            assert (ASSETS / folder / name).is_file(), (folder, name)
    assert "NOT included" in (ASSETS / "charades_sta" / "ATTRIBUTION.md").read_text()
    assert "non-commercial" in (ASSETS / "charades_sta" / "ATTRIBUTION.md").read_text()
    assert "dpg_bench.csv` is NOT shipped" in (ASSETS / "dpg_bench" / "ATTRIBUTION.md").read_text()
    readme = (ASSETS / "README.md").read_text()
    for needed in ("dpg_bench.csv", "RefCOCO", "COCO train2014", "Charades v1 videos", "HPSv2"):
        assert needed in readme


# ---------------------------------------------------------------------------------------------- the loaders

def test_geneval_shipped():
    items = B.load_geneval()
    assert len(items) == 553
    assert Counter(i.tag for i in items) == {"single_object": 80, "two_object": 99, "counting": 80, "colors": 94,
                                             "position": 100, "color_attr": 100}
    assert items.counts == {"prompts": 553, "single_object": 80, "two_object": 99, "counting": 80, "colors": 94,
                            "position": 100, "color_attr": 100}
    lines = (ASSETS / "geneval" / "evaluation_metadata.jsonl").read_text().splitlines()
    assert [i.metadata() for i in items] == [json.loads(line) for line in lines]
    assert [i.index for i in items] == list(range(553)) and [i.line for i in items] == list(range(1, 554))
    prompts = (ASSETS / "geneval" / "generation_prompts.txt").read_text().splitlines()
    assert [i.prompt for i in items] == prompts
    counting = [i for i in items if i.tag == "counting"]
    assert all(len(i.exclude) == 1 and i.exclude[0].count == i.include[0].count + 1 for i in counting)
    position = [i for i in items if i.tag == "position"]
    assert all(i.include[1].position[1] == 0 and i.include[1].position[0] in B.GENEVAL_RELATIONS for i in position)


def test_geneval_agrees_with_the_reward():
    from mmrl.rewards import geneval as reward

    assert tuple(reward.COLORS) == B.GENEVAL_COLORS and tuple(reward.TAGS) == B.GENEVAL_TAGS
    assert tuple(reward.POSITIONS) == B.GENEVAL_RELATIONS
    names = (ASSETS / "geneval" / "object_names.txt").read_text().splitlines()
    assert names == reward.GENEVAL_CLASSES
    assert all(reward.check_geneval_metadata(i.metadata()) is None for i in B.load_geneval())


@pytest.mark.parametrize("category", B.T2I_CATEGORIES)
def test_t2i_compbench_val(category):
    items = B.load_t2i_compbench(category)
    assert len(items) == 300 and len({i.prompt for i in items}) == 300
    assert all("\r" not in i.prompt and "\n" not in i.prompt and i.prompt.strip() for i in items)
    assert all(i.category == category and i.split == "val" for i in items)
    assert [i.index for i in items] == list(range(300))
    # the official reading: text mode (universal newlines), splitlines, text before a tab
    with open(ASSETS / "t2i_compbench" / "dataset" / f"{category}_val.txt") as f:
        official = [d.strip("\n").split("\t")[0] for d in f.read().splitlines()]
    assert [i.prompt for i in items] == official
    if category == "complex":
        assert Counter(i.complex_kind for i in items) == {"action": 212, "spatial": 58, "all": 30}
        spatialaction = (ASSETS / "t2i_compbench" / "dataset" / "complex_val_spatialaction.txt").read_text().splitlines()
        assert {i.prompt for i in items if i.complex_kind == "all"} == set(spatialaction)
    else:
        assert all(i.complex_kind is None for i in items)


def test_t2i_compbench_seen_unseen_and_errors(tmp_path):
    for category in ("color", "shape", "texture"):
        assert len(B.load_t2i_compbench(category, "val_seen")) == 200
        assert len(B.load_t2i_compbench(category, "val_unseen")) == 100
    with pytest.raises(DataError, match="unknown T2I-CompBench category 'colour'"):
        B.load_t2i_compbench("colour")
    with pytest.raises(DataError, match="split 'train' is not shipped"):
        B.load_t2i_compbench("color", "train")
    own = tmp_path / "mine.txt"
    own.write_bytes(b"a red apple\r\na blue bird\tignored column\r\n\r\n")
    items = B.load_t2i_compbench("color", "train", path=own)
    assert [i.prompt for i in items] == ["a red apple", "a blue bird"] and items[1].line == 2
    (tmp_path / "bad.txt").write_bytes(b"ok\n\tonly a tab column\n")
    with pytest.raises(DataError, match=r"bad\.txt:2: empty prompt"):
        B.load_t2i_compbench("color", path=tmp_path / "bad.txt")
    with pytest.raises(DataError, match=r"not found: .*nowhere\.txt \(.*Karine-Huang/T2I-CompBench"):
        B.load_t2i_compbench("shape", path=tmp_path / "nowhere.txt")


def test_ocr_shipped():
    from mmrl.rewards.ocr import extract_target

    items = B.load_ocr_prompts()
    assert len(items) == 1018 and items.counts == {"prompts": 1018, "multiple_quoted": 0}
    assert all(i.target == i.prompt.split('"')[1] for i in items)
    assert all(i.target == extract_target(i.prompt) for i in items)
    assert min(len(i.target) for i in items) == 2 and max(len(i.target) for i in items) == 29
    assert items[0].target == "Spring Collection 2024"


def test_partiprompts_shipped():
    items = B.load_partiprompts()
    assert len(items) == 1632 and items.counts == {"prompts": 1632, "categories": 12, "challenges": 11}
    assert Counter(i.category for i in items) == {
        "Animals": 314, "Artifacts": 287, "World Knowledge": 214, "People": 177, "Outdoor Scenes": 131,
        "Illustrations": 124, "Vehicles": 104, "Food & Beverage": 74, "Arts": 66, "Abstract": 51,
        "Produce & Plants": 50, "Indoor Scenes": 40}
    assert Counter(i.challenge for i in items)["Basic"] == 272
    assert items[0].prompt == "bond" and items[0].line == 2


def test_drawbench_shipped():
    unique = B.load_drawbench()
    assert len(unique) == 200 and unique.counts == {"lines": 200, "prompts": 200, "repeats": 0}
    repeated = B.load_drawbench(ASSETS / "drawbench" / "test.txt")
    assert [i.prompt for i in repeated] == [i.prompt for i in unique]
    assert repeated.counts == {"lines": 1000, "prompts": 200, "repeats": 800}
    assert not hasattr(unique[0], "category")


def test_charades_sta_shipped():
    queries = B.load_charades_sta()
    assert len(queries) == 3720 and len({q.video_id for q in queries}) == 1334
    assert queries.counts == {"queries": 3720, "videos": 1334, "ends_past_duration": 562}
    assert sum(q.end_past_duration for q in queries) == 562
    assert all(q.start < q.end and q.duration is not None for q in queries)
    assert all(q.clipped_end <= q.duration for q in queries)
    first = queries[0]
    assert (first.video_id, first.start, first.end, first.sentence, first.duration) == (
        "3MSZA", 24.3, 30.4, "person turn a light on.", 30.96)
    txt = B.load_charades_sta(ASSETS / "charades_sta" / "charades_sta_test.txt")
    assert txt.counts == {"queries": 3720, "videos": 1334, "ends_past_duration": 0}
    assert all(q.duration is None for q in txt) and txt[0].line == 1
    as_tuples = lambda qs: Counter((q.video_id, q.start, q.end, q.sentence) for q in qs)  # noqa: E731
    assert as_tuples(txt) == as_tuples(queries)


def test_dpg_prompts_shipped():
    prompts = B.load_dpg_prompts()
    assert len(prompts) == 1065
    ids = dict(prompts)
    assert "159" not in ids and "partiprompts323" in ids and "COCOval" not in ids
    assert Counter(k.rstrip("0123456789") or "numeric" for k in ids) == {
        "partiprompts": 324, "numeric": 299, "COCOval": 100, "countbench": 40, "diffusiondb": 40, "drawtext": 40,
        "midjourney": 40, "posescript": 40, "stanford": 40, "vrd": 40, "whoops": 40, "localized": 22}
    assert all(p == p.strip() and p for p in ids.values())


def test_registry():
    assert B.benchmark_names() == list(B.BENCHMARKS) == [
        "geneval", "t2i_compbench", "dpg_bench", "ocr", "partiprompts", "drawbench", "charades_sta", "hpsv2"]
    for name in ("geneval", "ocr", "partiprompts", "drawbench", "charades_sta"):
        items = B.BENCHMARKS[name]()
        assert isinstance(items, B.BenchmarkItems) and items.benchmark == name and items.source.is_file()
    assert set(B.USER_SUPPLIED) >= {"dpg_bench", "hpsv2", "refcoco"}


# -------------------------------------------------------------------------------------- DPG-Bench (synthetic)

HEADER = ["item_id", "text", "keywords", "proposition_id", "dependency", "category_broad", "category_detailed",
          "tuple", "question_natural_language"]


def prompt_of(item_id: str) -> str:
    return (ASSETS / "dpg_bench" / "prompts" / f"{item_id}.txt").read_text().strip()


def dpg_rows():
    """Two items in dpg_bench.csv's format: one row per question; dependency '0' = no parent."""
    a, b = prompt_of("0"), prompt_of("partiprompts5")
    return [
        ["0", a, "cabbages, field", "1", "0", "entity", "whole", "entity - whole (cabbages)", "Are there cabbages?"],
        ["0", a, "cabbages, field", "2", "0", "entity", "whole", "entity - whole (field)", "Is there a field?"],
        ["0", a, "cabbages, field", "3", "1", "other", "count", "other - count (cabbages, ==8)", "Are there eight cabbages?"],
        ["0", a, "cabbages, field", "4", "1,2", "relation", "spatial", "relation - spatial (cabbages, field, in)",
         "Are the cabbages in the field?"],
        ["partiprompts5", b, "kangaroo", "1", "0", "entity", "whole", "entity - whole (kangaroo)", "Is there a kangaroo?"],
        ["partiprompts5", b, "kangaroo", "2", "1", "attribute", "color", "attribute - color (hoodie, orange)",
         "Is the hoodie orange?"],
    ]


def write_csv(path: Path, rows, header=HEADER) -> Path:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")  # pandas' to_csv quoting: only fields that need it
    writer.writerow(header)
    writer.writerows(rows)
    path.write_text(buffer.getvalue(), encoding="utf-8")
    return path


def test_dpg_bench_synthetic(tmp_path):
    csv_path = write_csv(tmp_path / "dpg_bench.csv", dpg_rows())
    items = B.load_dpg_bench(csv_path)
    assert [i.item_id for i in items] == ["0", "partiprompts5"]
    first = items[0]
    assert [q.proposition_id for q in first.questions] == [1, 2, 3, 4]
    assert [q.dependency for q in first.questions] == [(0,), (0,), (1,), (1, 2)]
    assert [q.parents for q in first.questions] == [(), (), (1,), (1, 2)]
    assert first.questions[3].category == "relation - spatial" and first.questions[3].category_l1 == "relation"
    assert first.questions[2].category == "other - count" and first.questions[2].tuple_.endswith("==8)")
    assert first.prompt == prompt_of("0") == first.text and first.prompt_file.name == "0.txt"
    assert first.line == 2 and first.questions[3].line == 5 and items[1].line == 6
    assert not first.official_fails
    assert items.counts["items"] == 2 and items.counts["questions"] == 6
    assert items.counts["text_differs_from_prompt_file"] == 0 and items.counts["dropped_rows"] == 0
    assert items.counts["prompts_without_questions"] == 1063
    # without the prompt files the csv text is the prompt
    assert B.load_dpg_bench(csv_path, prompts_dir=False)[1].prompt_file is None


def test_dpg_bench_official_quirks(tmp_path):
    rows = dpg_rows()
    csv_path = write_csv(tmp_path / "dpg_bench.csv", rows)
    items = B.load_dpg_bench(csv_path, official_quirks=True)
    # the first data row (item 0, proposition 1) is gone; its children now name a missing parent
    assert [q.proposition_id for q in items[0].questions] == [2, 3, 4]
    assert items[0].missing_parents == (1,) and items[0].official_fails
    assert not items[1].official_fails
    assert items.counts["dropped_rows"] == 1 and items.counts["items_failing_official"] == 1
    assert items.counts["questions"] == 5
    # a repeated (non-contiguous) block replaces the earlier one, as the scorer's dict does
    rows2 = rows + [["0", rows[0][1], "", "9", "0", "entity", "whole", "entity - whole (dew)", "Is there dew?"]]
    csv2 = write_csv(tmp_path / "again.csv", rows2)
    quirky = B.load_dpg_bench(csv2, official_quirks=True)
    assert [q.proposition_id for q in quirky[1].questions] == [9] and quirky[1].item_id == "0"
    assert quirky.counts["replaced_blocks"] == 1
    with pytest.raises(DataError, match=r"again\.csv:8: item '0' appears again \(its rows started at line 2\)"):
        B.load_dpg_bench(csv2)


def test_dpg_bench_bad_inputs(tmp_path):
    rows = dpg_rows()
    bad = [r[:] for r in rows]
    bad[3][4] = "1,7"  # proposition 4 depends on a proposition 7 that item 0 does not have
    with pytest.raises(DataError, match=r"dangling\.csv:5: item '0' proposition 4: dependency 7 names no proposition"):
        B.load_dpg_bench(write_csv(tmp_path / "dangling.csv", bad))
    bad = [r[:] for r in rows]
    bad[5][4] = "2"  # a question depending on itself
    with pytest.raises(DataError, match=r"self\.csv:7: .*dependency 2 names its own proposition"):
        B.load_dpg_bench(write_csv(tmp_path / "self.csv", bad))
    bad = [r[:] for r in rows]
    bad[1][3] = "two"
    with pytest.raises(DataError, match=r"pid\.csv:3: column 'proposition_id' must be an integer, got 'two'"):
        B.load_dpg_bench(write_csv(tmp_path / "pid.csv", bad))
    bad = [r[:] for r in rows]
    bad[2][4] = "1;2"
    with pytest.raises(DataError, match=r"dep\.csv:4: column 'dependency' must be an integer, got '1;2'"):
        B.load_dpg_bench(write_csv(tmp_path / "dep.csv", bad))
    bad = [r[:] for r in rows]
    bad[1][3] = "1"
    with pytest.raises(DataError, match=r"dup\.csv:3: item '0' repeats proposition_id 1 \(first at line 2\)"):
        B.load_dpg_bench(write_csv(tmp_path / "dup.csv", bad))
    with pytest.raises(DataError, match=r"cols\.csv:1: header lacks column\(s\) \['dependency'\]"):
        B.load_dpg_bench(write_csv(tmp_path / "cols.csv", [r[:4] + r[5:] for r in rows],
                                   header=HEADER[:4] + HEADER[5:]))
    short = tmp_path / "short.csv"
    short.write_text(",".join(HEADER) + "\n0,text,kw,1,0\n")
    with pytest.raises(DataError, match=r"short\.csv:2: expected 9 fields"):
        B.load_dpg_bench(short)
    bad = [r[:] for r in rows]
    bad[4][0] = bad[5][0] = "no_such_item"
    with pytest.raises(DataError, match=r"ids\.csv:6: item 'no_such_item' has no prompt file"):
        B.load_dpg_bench(write_csv(tmp_path / "ids.csv", bad))
    assert len(B.load_dpg_bench(tmp_path / "ids.csv", prompts_dir=False)) == 2
    with pytest.raises(DataError, match=r"not found: .*missing\.csv \(dpg_bench.csv is not shipped; download it from "
                                        r"https://github.com/TencentQQGYLab/ELLA"):
        B.load_dpg_bench(tmp_path / "missing.csv")


# ------------------------------------------------------------------------------------------------ bad inputs

def geneval_file(tmp_path: Path, *records) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path = tmp_path / "evaluation_metadata.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = {"tag": "single_object", "include": [{"class": "bench", "count": 1}], "prompt": "a photo of a bench"}


@pytest.mark.parametrize("record, message", [
    ('{"tag": "single_object", "include": [', r":2: not valid JSON"),
    ({**GOOD, "tag": "colour"}, r":2: unknown tag 'colour'"),
    ({**GOOD, "include": [{"class": "bench", "count": 0}]}, r":2: include clause 0: 'count' must be an integer >= 1, got 0"),
    ({**GOOD, "include": [{"class": "bench", "count": True}]}, r":2: include clause 0: 'count' must be an integer"),
    ({**GOOD, "include": [{"class": "bench"}]}, r":2: include clause 0: missing 'count'"),
    ({**GOOD, "include": [{"class": "unicorn", "count": 1}]}, r":2: include clause 0: class 'unicorn' is not in"),
    ({**GOOD, "include": [{"class": "bench", "count": 1, "color": "teal"}]}, r":2: include clause 0: unknown color 'teal'"),
    ({**GOOD, "include": [{"class": "bench", "count": 1, "position": ["left of", 0]}]},
     r":2: include clause 0: 'position' must be \[relation, index of an earlier include clause\]"),
    ({**GOOD, "include": [{"class": "bench", "count": 1}, {"class": "cat", "count": 1, "position": ["beside", 0]}]},
     r":2: include clause 1: 'position' must be"),
    ({**GOOD, "exclude": [{"class": "bench", "count": 2, "color": "red"}]}, r":2: exclude clause 0: unknown field"),
    ({**GOOD, "include": []}, r":2: 'include' must be a non-empty list"),
    ({"tag": "single_object", "include": GOOD["include"]}, r":2: missing 'prompt'"),
    ({**GOOD, "extra": 1}, r":2: unknown field\(s\) \['extra'\]"),
    ("[1, 2]", r":2: expected a JSON object"),
    ("", r":2: blank line"),
])
def test_geneval_bad_lines(tmp_path, record, message):
    path = geneval_file(tmp_path, GOOD, record, GOOD)
    with pytest.raises(DataError, match=r"evaluation_metadata\.jsonl" + message):
        B.load_geneval(path)


def test_geneval_own_file_and_missing(tmp_path):
    good = {"tag": "position", "include": [{"class": "cat", "count": 1},
                                           {"class": "dog", "count": 1, "position": ["right of", 0]}], "prompt": "p"}
    items = B.load_geneval(geneval_file(tmp_path, GOOD, good))
    assert items[1].include[1].position == ("right of", 0) and items[1].metadata() == good
    (tmp_path / "object_names.txt").write_text("cat\n")  # a sibling class list is used when present
    with pytest.raises(DataError, match=r":1: include clause 0: class 'bench' is not in"):
        B.load_geneval(tmp_path / "evaluation_metadata.jsonl")
    with pytest.raises(DataError, match=r"not found: .*absent\.jsonl \(.*djghosh13/geneval"):
        B.load_geneval(tmp_path / "sub" / "absent.jsonl")


def test_ocr_bad_lines(tmp_path):
    path = tmp_path / "ocr.txt"
    path.write_text('A sign saying "OPEN".\n\nA poster with no quoted text at all\n')
    with pytest.raises(DataError, match=r'ocr\.txt:3: no quoted text'):
        B.load_ocr_prompts(path)
    path.write_text('A sign saying "OPEN".\nAn unclosed "quote\n')
    with pytest.raises(DataError, match=r'ocr\.txt:2: no quoted text'):
        B.load_ocr_prompts(path)
    path.write_text('A sign saying " ".\n')
    with pytest.raises(DataError, match=r'ocr\.txt:1: the quoted target text is empty'):
        B.load_ocr_prompts(path)
    path.write_text('A sign saying "OPEN" and "CLOSED".\n\nA cup reading "hi"\n')
    items = B.load_ocr_prompts(path)
    assert [(i.target, i.line) for i in items] == [("OPEN", 1), ("hi", 3)] and items.counts["multiple_quoted"] == 1
    with pytest.raises(DataError, match=r"not found: .*none\.txt \(.*flow_grpo"):
        B.load_ocr_prompts(tmp_path / "none.txt")


def test_charades_bad_lines(tmp_path):
    txt = tmp_path / "sta.txt"
    txt.write_text("AAAAA 1.0 2.5##a person sits.\nBBBBB 4.0 4.0##a person stands.\n")
    with pytest.raises(DataError, match=r"sta\.txt:2: start must be before end, got start 4.0 >= end 4.0"):
        B.load_charades_sta(txt)
    txt.write_text("AAAAA 1.0 2.5##a person sits.\nBBBBB 5.0 4.0##x\n")
    with pytest.raises(DataError, match=r"sta\.txt:2: start must be before end"):
        B.load_charades_sta(txt)
    txt.write_text("AAAAA 1.0 2.5 a person sits.\n")
    with pytest.raises(DataError, match=r"sta\.txt:1: expected 'VIDEO_ID START END##sentence'"):
        B.load_charades_sta(txt)
    txt.write_text("AAAAA 1.0 x##a person sits.\n")
    with pytest.raises(DataError, match=r"sta\.txt:1: START and END must be numbers"):
        B.load_charades_sta(txt)
    js = tmp_path / "sta.json"
    data = {"AAAAA": {"duration": 10.0, "timestamps": [[1.0, 2.0]], "sentences": ["a"]},
            "BBBBB": {"duration": 10.0, "timestamps": [[1.0, 12.0], [3.0, 3.0]], "sentences": ["b", "c"]}}
    js.write_text(json.dumps(data, indent=1))
    text = js.read_text()
    line = text[:text.index('"BBBBB"')].count("\n") + 1
    with pytest.raises(DataError, match=rf"sta\.json:{line}:2: video 'BBBBB' moment 1: start must be before end"):
        B.load_charades_sta(js)
    data["BBBBB"]["timestamps"][1] = [3.0, 4.0]
    js.write_text(json.dumps(data))
    queries = B.load_charades_sta(js)
    assert queries.counts == {"queries": 3, "videos": 2, "ends_past_duration": 1}
    assert queries[1].end_past_duration and queries[1].clipped_end == 10.0
    js.write_text('{"AAAAA": {"duration": 10.0,\n "timestamps": [[1.0, 2.0]] "sentences": ["a"]}}')
    with pytest.raises(DataError, match=r"sta\.json:2: not valid JSON"):
        B.load_charades_sta(js)
    with pytest.raises(DataError, match=r"not found: .*gone\.json \(.*allenai\.org/plato/charades"):
        B.load_charades_sta(tmp_path / "gone.json")


def test_parti_drawbench_hpsv2_bad_inputs(tmp_path):
    tsv = tmp_path / "parti.tsv"
    tsv.write_text("Prompt\tCategory\tChallenge\tNote\nbond\tAbstract\tBasic\t\nbroken\tAbstract\n")
    with pytest.raises(DataError, match=r"parti\.tsv:3: expected 4 tab-separated fields"):
        B.load_partiprompts(tsv)
    tsv.write_text("prompt,category\n")
    with pytest.raises(DataError, match=r"parti\.tsv:1: expected the header"):
        B.load_partiprompts(tsv)
    (tmp_path / "draw.txt").write_bytes(b"ok\n\xff\xfe\n")
    with pytest.raises(DataError, match=r"draw\.txt:2: not UTF-8 text"):
        B.load_drawbench(tmp_path / "draw.txt")
    styles = tmp_path / "hps"
    styles.mkdir()
    for style in B.HPSV2_STYLES:
        (styles / f"{style}.json").write_text(json.dumps([f"{style} one", f"{style} two"]))
    prompts = B.load_hpsv2(styles)
    assert prompts.counts == {"prompts": 8, "anime": 2, "concept-art": 2, "paintings": 2, "photo": 2}
    assert (prompts[2].style, prompts[2].index) == ("concept-art", 0)
    (styles / "photo.json").write_text('["a", 3]')
    with pytest.raises(DataError, match=r"photo\.json:1: entry 1 must be a non-empty string"):
        B.load_hpsv2(styles)
    (styles / "photo.json").unlink()
    with pytest.raises(DataError, match=r"not found: .*photo\.json \(.*zhwang/HPDv2"):
        B.load_hpsv2(styles)


def test_assets_are_tracked_by_git_not_ignored():
    repo = Path(__file__).resolve().parents[1]
    probe = ["assets/benchmarks/ocr/test.txt", "assets/benchmarks/dpg_bench/prompts/0.txt"]
    try:
        result = subprocess.run(["git", "-C", str(repo), "check-ignore", *probe], capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("git is not installed")
    if result.returncode == 128:
        pytest.skip("not a git checkout")
    assert result.stdout.strip() == "", f"ignored by git: {result.stdout}"
