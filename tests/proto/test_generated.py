"""The committed code in proto/v1/ is what proto/v1/tandem.proto generates today, and the API has the shape its
clients rely on."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.proto import generate as proto_generate
from tandem.proto.v1 import tandem_pb2, tandem_pb2_grpc

COMMITTED = Path(proto_generate.__file__).resolve().parent / "v1"


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("proto-v1")
    written = proto_generate.generate(out)
    assert sorted(p.name for p in written) == sorted(proto_generate.OUTPUTS)
    return out


@pytest.mark.parametrize("name", proto_generate.OUTPUTS)
def test_committed_code_matches_the_proto(regenerated, name):
    assert name in ("tandem_pb2.py", "tandem_pb2.pyi", "tandem_pb2_grpc.py")
    assert (COMMITTED / name).read_bytes() == (regenerated / name).read_bytes(), (
        f"proto/v1/{name} is stale: run `python -m tandem.proto.generate` and commit the result")


def test_the_proto_package_is_tandem_v1():
    assert tandem_pb2.DESCRIPTOR.package == "tandem.v1"
    assert tandem_pb2.DESCRIPTOR.name == "tandem/proto/v1/tandem.proto"
    assert tandem_pb2.GenerateRequest.DESCRIPTOR.full_name == "tandem.v1.GenerateRequest"


def test_the_tandem_service_methods():
    service = tandem_pb2.DESCRIPTOR.services_by_name["Tandem"]
    assert service.full_name == "tandem.v1.Tandem"
    methods = {m.name: m for m in service.methods}
    assert set(methods) == {"Generate", "Abort", "ListModels"}
    shapes = {name: (m.input_type.name, m.output_type.name, m.client_streaming, m.server_streaming)
              for name, m in methods.items()}
    assert shapes == {
        "Generate": ("GenerateRequest", "GenerateResponse", False, True),
        "Abort": ("AbortRequest", "AbortResponse", False, False),
        "ListModels": ("ListModelsRequest", "ListModelsResponse", False, False),
    }


def test_the_generated_stub_and_servicer_expose_the_methods():
    for name in ("Generate", "Abort", "ListModels"):
        assert callable(getattr(tandem_pb2_grpc.TandemServicer, name))
    assert callable(tandem_pb2_grpc.add_TandemServicer_to_server)


def test_prompt_is_a_oneof_of_text_token_ids_and_chat():
    oneof = tandem_pb2.GenerateRequest.DESCRIPTOR.oneofs_by_name["prompt"]
    assert [f.name for f in oneof.fields] == ["text", "token_ids", "chat"]
    request = tandem_pb2.GenerateRequest(text="Hi")
    request.token_ids.ids.extend([1, 2])
    assert request.WhichOneof("prompt") == "token_ids" and not request.text
