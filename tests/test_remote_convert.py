"""Protobuf <-> dataclass conversion, the generated stubs, and the gRPC extra's import guard."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("grpc")

from specsplit.config import SamplingParams, TreeConfig  # noqa: E402
from specsplit.core.tree import TokenNode, TokenTree  # noqa: E402
from specsplit.errors import InvalidRequest  # noqa: E402
from specsplit.messages import (  # noqa: E402
    DraftRequest,
    DraftResult,
    HeadGuesses,
    VerifyRequest,
    VerifyResult,
    WorkerInfo,
    WorkerStats,
)
from specsplit.remote import convert  # noqa: E402
from specsplit.remote._generated import spec_decoding_pb2 as pb  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ROOT / "specsplit" / "remote" / "_generated"


def random_tree(n: int, kq: int | None, seed: int = 0) -> TokenTree:
    g = torch.Generator().manual_seed(seed)
    # Sorted draws keep parents[i] < i and give BFS order (what the draft produces).
    parents = sorted([-1][:n] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, n)])
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    tree = TokenTree(
        token_ids=torch.randint(0, 50_000, (n,), generator=g),
        parents=torch.tensor(parents, dtype=torch.long),
        depths=torch.tensor(depths, dtype=torch.long),
        log_probs=-torch.rand(n, generator=g),  # float32
    )
    if n:
        tree.log_probs[0] = -math.inf  # a zero-probability node must survive the trip
    if kq is not None:
        tree.q_ids = torch.randint(0, 50_000, (n, kq), generator=g)
        q = torch.rand(n, kq, generator=g)
        tree.q_probs = q / q.sum(-1, keepdim=True)
        if n > 1:
            tree.q_probs[1] = 0.0  # a padding row
    return tree


def assert_trees_equal(a: TokenTree, b: TokenTree) -> None:
    for name in ("token_ids", "parents", "depths", "log_probs", "q_ids", "q_probs"):
        x, y = getattr(a, name), getattr(b, name)
        if x is None or y is None:
            assert x is None and y is None, name
            continue
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.view(torch.int32) if x.dtype == torch.float32 else x,
                           y.view(torch.int32) if y.dtype == torch.float32 else y), name  # fmt: skip


@pytest.mark.parametrize("n", [0, 1, 16, 64])
@pytest.mark.parametrize("kq", [None, 1, 32])
def test_tree_round_trip_is_bit_exact(n: int, kq: int | None) -> None:
    tree = random_tree(n, kq, seed=n)
    back = convert.tree_from_proto(pb.TokenTree.FromString(convert.tree_to_proto(tree).SerializeToString()))
    assert_trees_equal(tree, back)
    assert back.device.type == "cpu"


def test_tree_bounds_travel_and_are_checked() -> None:
    tree = random_tree(16, None, seed=3)
    branch, depth = TokenTree(tree.token_ids, tree.parents, tree.depths, tree.log_probs).bounds()
    tree.max_branch, tree.depth_bound = branch + 2, depth + 3  # producers may send loose bounds
    back = convert.tree_from_proto(convert.tree_to_proto(tree))
    assert (back.max_branch, back.depth_bound) == (branch + 2, depth + 3)
    for field, value in (("max_branch", branch - 1), ("depth_bound", depth - 1)):
        m = convert.tree_to_proto(tree)
        setattr(m, field, value)
        with pytest.raises(InvalidRequest, match=field):
            convert.tree_from_proto(m)
    plain = convert.tree_from_proto(convert.tree_to_proto(TokenTree(tree.token_ids, tree.parents, tree.depths,
                                                                    tree.log_probs)))  # fmt: skip
    assert plain.max_branch is None and plain.bounds() == (branch, depth)


def test_flat_proto_matches_nested_token_nodes() -> None:
    """The mapping documented in the .proto: node i <-> TokenNode, children = nodes with parent i."""
    tree = random_tree(24, 4, seed=7)
    m = convert.tree_to_proto(tree)
    nodes = [
        TokenNode(
            token_id=m.token_ids[i],
            log_prob=m.log_probs[i],
            top_k_token_ids=list(m.q_ids[i * m.q_width : (i + 1) * m.q_width]),
            top_k_probs=list(m.q_probs[i * m.q_width : (i + 1) * m.q_width]),
        )
        for i in range(len(m.token_ids))
    ]
    roots = []
    for i, p in enumerate(m.parents):
        (roots if p == -1 else nodes[p].children).append(nodes[i])
    assert [r.to_dict() for r in roots] == [r.to_dict() for r in tree.to_nodes()]
    assert_trees_equal(TokenTree.from_nodes(roots), tree)


@pytest.mark.parametrize(
    "tree",
    [
        TreeConfig(shape="chain", num_draft_tokens=7),
        TreeConfig(shape="static"),
        TreeConfig(shape="static", paths=[[0], [1], [0, 0]]),
        TreeConfig(shape="dynamic", topk=3, width=2, budget=40, max_depth=9),
    ],
)
def test_requests_and_results_round_trip(tree: TreeConfig) -> None:
    sampling = SamplingParams(do_sample=True, temperature=0.7, top_k=20, top_p=0.9)
    for seed in (None, 0, 2**62 - 1, 2**64 - 1):
        dreq = DraftRequest("s1", [5, 6, 7], 12, tree, sampling, seed, 3, 400)
        back = convert.draft_request_from_proto(pb.DraftRequest.FromString(
            convert.draft_request_to_proto(dreq).SerializeToString()))  # fmt: skip
        assert back == dreq
    t = random_tree(5, 8)
    vreq = VerifyRequest("s2", t, [9], 40, sampling, 123, 4096)
    vback = convert.verify_request_from_proto(convert.verify_request_to_proto(vreq))
    assert_trees_equal(vback.tree, t)
    vback.tree = t
    assert vback == vreq
    stats = WorkerStats(
        wall_time_s=0.25,
        model_time_s=0.125,
        tokens_processed=17,
        forwards=3,
        device="cuda:1",
        verify_mode="partial",
        server_time_s=0.5,
    )
    dres = DraftResult(t, 41, stats, cache_hit=True)
    dres_back = convert.draft_result_from_proto(convert.draft_result_to_proto(dres))
    assert_trees_equal(dres_back.tree, t)
    dres_back.tree = t
    assert dres_back.stats.server_time_s == 0.5 and dres_back.stats.busy_s == 0.5  # the handler's time
    assert dres_back == dres
    vres = VerifyResult([4, 5], 6, [0, 2], 44, 4, 5, stats, cache_hit=True)
    assert convert.verify_result_from_proto(convert.verify_result_to_proto(vres)) == vres
    info = WorkerInfo("target", "m", 151936, "bfloat16", "cuda:0", "specsplit.v1", 3)
    assert convert.worker_info_from_proto(convert.worker_info_to_proto(info)) == info


def test_draft_head_guesses_round_trip() -> None:
    """``return_guesses`` travels both ways; ``guesses`` None <-> absent, an empty guess set stays
    present, and parents of -1 survive the wire."""
    for ask in (False, True):
        req = VerifyRequest("s", TokenTree.empty(), [1], 0, return_guesses=ask)
        wire = pb.VerifyRequest.FromString(convert.verify_request_to_proto(req).SerializeToString())
        assert convert.verify_request_from_proto(wire).return_guesses is ask
    for guesses in (
        None,
        HeadGuesses([], [], []),
        HeadGuesses([7, 151_935, 9, 2**40], [-1, -1, 0, 2], [1, 1, 2, 3]),
    ):
        res = VerifyResult([3], 4, [0], 9, 1, 1, guesses=guesses)
        m = pb.VerifyResponse.FromString(convert.verify_result_to_proto(res).SerializeToString())
        assert m.HasField("guesses") == (guesses is not None)
        assert convert.verify_result_from_proto(m) == res


def test_malformed_guesses_raise_invalid_request() -> None:
    m = convert.verify_result_to_proto(
        VerifyResult([3], 4, [0], 9, 1, 1, guesses=HeadGuesses([7, 8], [-1, 0], [1, 2]))
    )
    m.guesses.depths.pop()
    with pytest.raises(InvalidRequest, match="depths"):
        convert.verify_result_from_proto(m)


def test_paths_none_and_empty_differ_on_the_wire() -> None:
    assert not convert.tree_config_to_proto(TreeConfig(shape="static")).HasField("static_paths")
    m = convert.tree_config_to_proto(TreeConfig(shape="static", paths=[[0]]))
    assert m.HasField("static_paths") and len(m.static_paths.paths) == 1


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda m: m.tree.parents.pop(), "parents"),
        (lambda m: m.tree.log_probs.append(0.0), "log_probs"),
        (lambda m: m.tree.q_ids.append(1), "has_q"),
        (lambda m: (setattr(m.tree, "has_q", True), setattr(m.tree, "q_width", 2)), "q_width"),
        (lambda m: setattr(m.sampling, "top_p", 0.0), "top_p"),
        (
            lambda m: (setattr(m.sampling, "do_sample", True), setattr(m.sampling, "temperature", 0.0)),
            "temperature",
        ),  # fmt: skip
    ],
)
def test_malformed_verify_messages_raise_invalid_request(mutate, match: str) -> None:
    m = convert.verify_request_to_proto(VerifyRequest("s", random_tree(3, None), [1], 0))
    mutate(m)
    with pytest.raises(InvalidRequest, match=match):
        convert.verify_request_from_proto(m)


def test_malformed_tree_specs_raise_invalid_request() -> None:
    m = convert.tree_config_to_proto(TreeConfig())
    m.shape = pb.TREE_SHAPE_UNSPECIFIED
    with pytest.raises(InvalidRequest, match="shape"):
        convert.tree_config_from_proto(m)
    m = convert.tree_config_to_proto(TreeConfig(shape="static", paths=[[0]]))
    m.static_paths.paths.add(ranks=[2])
    with pytest.raises(InvalidRequest, match="paths"):
        convert.tree_config_from_proto(m)


def test_seeds_outside_uint64_are_refused() -> None:
    for seed in (-1, 2**64):
        with pytest.raises(InvalidRequest, match="seed"):
            convert.draft_request_to_proto(DraftRequest("s", [1], 0, seed=seed))


# ---------------------------------------------------------------------- stubs
def test_committed_stubs_are_current() -> None:
    pytest.importorskip("grpc_tools")
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_stubs
    finally:
        sys.path.pop(0)
    diffs = gen_stubs.stale_files(GENERATED)
    assert not diffs, "stubs are stale; run: python scripts/gen_stubs.py\n" + "\n".join(diffs)


def test_stubs_import_on_the_oldest_supported_runtimes() -> None:
    """grpcio 1.84 / protobuf 7.36.2 (the GPU machines) must import the committed stubs."""
    pb2 = (GENERATED / "spec_decoding_pb2.py").read_text()
    m = re.search(
        r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),",
        pb2,
    )
    assert m is not None
    assert tuple(int(x) for x in m.groups()) <= (7, 36, 2), "gencode newer than protobuf 7.36.2"
    grpc_src = (GENERATED / "spec_decoding_pb2_grpc.py").read_text()
    assert "GRPC_GENERATED_VERSION" not in grpc_src and "from . import spec_decoding_pb2" in grpc_src
    code = (
        "import grpc; grpc.__version__ = '1.84.0'\n"
        "from specsplit.remote._generated import spec_decoding_pb2_grpc as g\n"
        "assert g.TargetServiceStub and g.DraftServiceServicer\n"
        "grpc.__version__ = '1.60.0'\n"
        "import importlib\n"
        "try:\n"
        "    importlib.reload(g)\n"
        "except RuntimeError as e:\n"
        "    assert 'pip install' in str(e)\n"
        "else:\n"
        "    raise SystemExit('grpcio 1.60 was accepted')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_missing_grpc_says_what_to_install() -> None:
    code = (
        "import sys; sys.modules['grpc'] = None\n"
        "try:\n"
        "    import specsplit.remote\n"
        "except ImportError as e:\n"
        "    assert \"pip install 'specsplit[grpc]'\" in str(e), e\n"
        "else:\n"
        "    raise SystemExit('imported without grpc')\n"
        "import specsplit.cli\n"
        "p = specsplit.cli.build_parser()\n"  # the CLI still works, just without `serve`
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
