"""ncu_stall_regions: regions found from the SASS markers, samples summed per region and reason (CPU)."""
import csv

import pytest

from experiments.ncu_stall_regions import read_source_page, summarize

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_no_inst", "stall_long_sb",
          "stall_no_inst (Not Issued)"]
# (sass, samples, no_inst, long_sb): the region each line falls in is in the comment
LISTING = [
    ("LDC R1, c[0x0][0x28]", 1, 0, 0),                       # before the consumers: counted in no region
    ("USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe0", 2, 2, 0),     # loop top
    ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R27], R24", 3, 0, 3),
    ("QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8], RZ", 5, 0, 0),  # mainloop
    ("QGMMA.64x128x32.F32.E4M3.E4M3 R88, gdesc[UR8], RZ", 7, 0, 0),
    ("WARPGROUP.DEPBAR.LE gsb0, 0x0", 11, 0, 0),
    ("FADD R1, R1, R24", 13, 0, 0),
    ("LDG.E.STRONG.SYS R7, desc[UR26][R10.64]", 17, 0, 17),  # after
    ("FMUL R94, R110, R70", 19, 19, 0),
    ("STSM.16.M88.4 [R23+0x30000], R4", 23, 20, 0),         # stores
    ("USETMAXREG.DEALLOC.CTAPOOL 0x38", 29, 0, 0),           # producer
    ("@!P0 BRA 0x7f39637f6510", 31, 0, 31),
]


def write_page(path, listing):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "gemm_kernel"])
        w.writerow(HEADER)
        for i, (sass, n, ni, lsb) in enumerate(listing):
            w.writerow([hex(0x1000 + 16 * i), "      " + sass, n, ni, lsb, "-"])


def test_regions_and_reasons(tmp_path):
    write_page(tmp_path / "sass.csv", LISTING)
    header, rows = read_source_page(tmp_path / "sass.csv")
    result = summarize(header, rows, top=3)
    got = {r["region"]: (r["first"], r["end"], r["samples"]) for r in result["regions"]}
    assert got == {"loop top": (1, 3, 5), "mainloop": (3, 7, 36), "after": (7, 9, 36), "stores": (9, 10, 23),
                   "producer": (10, 12, 60)}
    assert result["samples"] == sum(n for _, n, _, _ in LISTING)
    after = next(r for r in result["regions"] if r["region"] == "after")
    assert after["by_reason"] == {"stall_long_sb": 17, "stall_no_inst": 19}
    assert [h["samples"] for h in result["hottest"]] == [23, 29, 31]
    assert [h["region"] for h in result["hottest"]] == ["stores", "producer", "producer"]


def test_the_epilogue_path_in_runs(tmp_path):
    # the columns above plus the executed count: the producer's two lines and one line of the epilogue not executed
    executed = [0, 8, 8, 8, 8, 8, 8, 8, 0, 8, 0, 0]
    with open(tmp_path / "sass.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "gemm_kernel"])
        w.writerow(HEADER + ["Instructions Executed"])
        for i, ((sass, n, ni, lsb), e) in enumerate(zip(LISTING, executed)):
            w.writerow([hex(0x1000 + 16 * i), "      " + sass, n, ni, lsb, "-", e])
    header, rows = read_source_page(tmp_path / "sass.csv")
    path = summarize(header, rows)["epilogue_path"]
    assert (path["first"], path["end"], path["executed"], path["runs"], path["no_inst"]) == (7, 10, 2, 2, 20)
    assert [(r["first"], r["length"], r["skipped_before"], r["samples"], r["no_inst"]) for r in path["run_list"]] == [
        (7, 1, 0, 17, 0), (9, 1, 1, 23, 20)]


def test_a_listing_without_the_markers_is_refused(tmp_path):
    write_page(tmp_path / "sass.csv", [row for row in LISTING if "STSM" not in row[0]])
    header, rows = read_source_page(tmp_path / "sass.csv")
    with pytest.raises(ValueError, match="STSM"):
        summarize(header, rows)
