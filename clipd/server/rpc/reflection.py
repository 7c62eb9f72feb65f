"""gRPC server reflection under both protocol names: ``grpc.reflection.v1`` and ``grpc.reflection.v1alpha``.

grpcio-reflection ships only v1alpha. v1 is the same protocol (same messages, same
field numbers) in the package ``grpc.reflection.v1``, so one servicer answers both:
v1alpha is registered as grpcio-reflection does it, and v1 is a generic handler
that parses and serializes with the v1alpha message classes. The v1 file itself is
added to the default descriptor pool (a renamed copy of v1alpha's), so that
reflection can describe the v1 service too.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection as v1alpha
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2
from grpc_reflection.v1alpha import reflection_pb2_grpc as v1alpha_pb2_grpc

V1ALPHA_SERVICE_NAME = v1alpha.SERVICE_NAME  # grpc.reflection.v1alpha.ServerReflection
V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
V1_FILE_NAME = "grpc/reflection/v1/reflection.proto"
METHOD = "ServerReflectionInfo"


def v1_file_descriptor_proto() -> descriptor_pb2.FileDescriptorProto:
    """v1alpha's reflection.proto renamed to v1: package, file name, type references and options."""
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha_pb2.DESCRIPTOR.CopyToProto(proto)
    old_prefix, new_prefix = f".{proto.package}.", f".{V1_PACKAGE}."

    def rename(type_name: str) -> str:
        return new_prefix + type_name[len(old_prefix):] if type_name.startswith(old_prefix) else type_name

    def rename_message(message: descriptor_pb2.DescriptorProto) -> None:
        for field in message.field:
            if field.type_name:
                field.type_name = rename(field.type_name)
        for nested in message.nested_type:
            rename_message(nested)

    proto.name, proto.package = V1_FILE_NAME, V1_PACKAGE
    for message in proto.message_type:
        rename_message(message)
    for service in proto.service:
        for method in service.method:
            method.input_type, method.output_type = rename(method.input_type), rename(method.output_type)
    proto.options.Clear()  # v1alpha's are deprecated and name the v1alpha packages
    proto.options.java_package = "io.grpc.reflection.v1"
    proto.options.java_outer_classname = "ServerReflectionProto"
    proto.options.java_multiple_files = True
    proto.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    return proto


def ensure_v1_descriptor(pool: descriptor_pool.DescriptorPool | None = None) -> None:
    """Adds the v1 reflection file to ``pool`` (the default one) unless it already has it."""
    pool = descriptor_pool.Default() if pool is None else pool
    try:
        pool.FindFileByName(V1_FILE_NAME)
        return
    except KeyError:
        pass
    try:
        pool.FindFileContainingSymbol(V1_SERVICE_NAME)
        return  # someone registered v1 under another file name: use theirs
    except KeyError:
        pass
    pool.AddSerializedFile(v1_file_descriptor_proto().SerializeToString())


def enable_reflection(service_names: Iterable[str], server: grpc.Server) -> None:
    """Serves reflection v1 and v1alpha on ``server``, listing ``service_names`` and both reflection services."""
    ensure_v1_descriptor()
    names = {*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME}
    servicer = v1alpha.ReflectionServicer(names)
    v1alpha_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1_handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=v1alpha_pb2.ServerReflectionRequest.FromString,  # wire-identical to v1's
        response_serializer=v1alpha_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {METHOD: v1_handler}),))
