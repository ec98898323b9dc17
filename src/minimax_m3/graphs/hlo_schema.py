"""Protobuf classes for the part of XLA's ``HloModuleProto`` that this package reads and NxD edits.

The Neuron compile path hands neuronx-cc one serialized ``xla.HloModuleProto`` per bucket (``graph.hlo``). To read
those files without the Neuron SDK (whose ``torch_neuronx.pyhlo`` holds the full generated classes) we build the
message classes at import time from a table of field names and numbers, through protobuf's own descriptor API.
Only fields we read are declared: protobuf keeps every other field as an unknown field and writes it back
unchanged, so a module parsed and re-serialized here loses nothing. Field numbers follow XLA's wire format
(``xla/service/hlo.proto`` and ``xla/xla_data.proto``, Apache-2.0; numbers are stable by XLA's own rule).

Importing this module needs only ``protobuf`` (it imports nothing from the Neuron SDK or torch).
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.internal import enum_type_wrapper

_F = descriptor_pb2.FieldDescriptorProto
_SCALARS = {"int64": _F.TYPE_INT64, "int32": _F.TYPE_INT32, "string": _F.TYPE_STRING, "bytes": _F.TYPE_BYTES,
            "bool": _F.TYPE_BOOL, "double": _F.TYPE_DOUBLE, "float": _F.TYPE_FLOAT}

PRIMITIVE_TYPES = {
    "PRIMITIVE_TYPE_INVALID": 0, "PRED": 1, "S8": 2, "S16": 3, "S32": 4, "S64": 5, "U8": 6, "U16": 7, "U32": 8,
    "U64": 9, "F16": 10, "F32": 11, "F64": 12, "TUPLE": 13, "OPAQUE_TYPE": 14, "C64": 15, "BF16": 16, "TOKEN": 17,
    "C128": 18, "F8E5M2": 19, "F8E4M3FN": 20, "S4": 21, "U4": 22, "F8E4M3B11FNUZ": 23, "F8E5M2FNUZ": 24,
    "F8E4M3FNUZ": 25, "S2": 26, "U2": 27, "F8E4M3": 28, "F8E3M4": 29, "S1": 30, "U1": 31, "F4E2M1FN": 32,
    "F8E8M0FNU": 33,
}
# bits per element; PRED is stored as one byte
ELEMENT_BITS = {
    "PRED": 8, "S8": 8, "U8": 8, "S16": 16, "U16": 16, "F16": 16, "BF16": 16, "S32": 32, "U32": 32, "F32": 32,
    "S64": 64, "U64": 64, "F64": 64, "C64": 64, "C128": 128, "S4": 4, "U4": 4, "S2": 2, "U2": 2, "S1": 1, "U1": 1,
    "F8E5M2": 8, "F8E4M3FN": 8, "F8E4M3B11FNUZ": 8, "F8E5M2FNUZ": 8, "F8E4M3FNUZ": 8, "F8E4M3": 8, "F8E3M4": 8,
    "F4E2M1FN": 4, "F8E8M0FNU": 8,
}

# message -> [(field, number, type, repeated)]; a type that is not a scalar names a message or an enum
_MESSAGES: dict[str, list[tuple[str, int, str, bool]]] = {
    "LayoutProto": [("minor_to_major", 1, "int64", True), ("element_size_in_bits", 7, "int64", False),
                    ("memory_space", 8, "int64", False)],
    "ShapeProto": [("element_type", 2, ".xla.PrimitiveType", False), ("dimensions", 3, "int64", True),
                   ("tuple_shapes", 4, ".xla.ShapeProto", True), ("layout", 5, ".xla.LayoutProto", False),
                   ("is_dynamic_dimension", 6, "bool", True)],
    "ProgramShapeProto": [("parameters", 1, ".xla.ShapeProto", True), ("result", 2, ".xla.ShapeProto", False),
                          ("parameter_names", 3, "string", True)],
    "OpMetadata": [("op_type", 1, "string", False), ("op_name", 2, "string", False),
                   ("source_file", 3, "string", False), ("source_line", 4, "int32", False),
                   ("stack_frame_id", 15, "int32", False)],
    "LiteralProto": [("shape", 1, ".xla.ShapeProto", False), ("preds", 2, "bool", True),
                     ("s32s", 4, "int32", True), ("s64s", 5, "int64", True), ("f32s", 8, "float", True)],
    "DotDimensionNumbers": [("lhs_contracting_dimensions", 1, "int64", True),
                            ("rhs_contracting_dimensions", 2, "int64", True),
                            ("lhs_batch_dimensions", 3, "int64", True), ("rhs_batch_dimensions", 4, "int64", True)],
    "ConvolutionDimensionNumbers": [("kernel_output_feature_dimension", 4, "int64", False)],
    "ReplicaGroup": [("replica_ids", 1, "int64", True)],
    "IotaReplicaGroupListProto": [("num_replica_groups", 1, "int64", False),
                                  ("num_devices_per_group", 2, "int64", False),
                                  ("iota_reshape_dims", 3, "int64", True), ("iota_transpose_perm", 4, "int32", True)],
    "CollectiveDeviceListProto": [("replica_groups", 1, ".xla.ReplicaGroup", True),
                                  ("iota_replica_group_list", 2, ".xla.IotaReplicaGroupListProto", False)],
    "FrontendAttributes": [("map", 1, ".xla.FrontendAttributes.MapEntry", True)],
    "HloInstructionProto": [
        ("name", 1, "string", False), ("opcode", 2, "string", False), ("shape", 3, ".xla.ShapeProto", False),
        ("metadata", 7, ".xla.OpMetadata", False), ("literal", 8, ".xla.LiteralProto", False),
        ("parameter_number", 9, "int64", False), ("tuple_index", 13, "int64", False),
        ("dimensions", 14, "int64", True),
        ("convolution_dimension_numbers", 16, ".xla.ConvolutionDimensionNumbers", False),
        ("slice_dimensions", 17, ".xla.HloInstructionProto.SliceDimensions", True),
        ("dynamic_slice_sizes", 20, "int64", True), ("channel_id", 26, "int64", False),
        ("custom_call_target", 28, "string", False),
        ("dot_dimension_numbers", 30, ".xla.DotDimensionNumbers", False), ("id", 35, "int64", False),
        ("operand_ids", 36, "int64", True), ("control_predecessor_ids", 37, "int64", True),
        ("called_computation_ids", 38, "int64", True), ("backend_config", 43, "bytes", False),
        ("is_host_transfer", 47, "bool", False), ("replica_groups", 49, ".xla.ReplicaGroup", True),
        ("operand_shapes_with_layout", 57, ".xla.ShapeProto", True), ("comparison_direction", 63, "string", False),
        ("custom_call_has_side_effect", 65, "bool", False),
        ("frontend_attributes", 68, ".xla.FrontendAttributes", False),
        ("use_global_device_ids", 71, "bool", False), ("custom_call_api_version", 77, "int32", False),
        ("feature_group_count", 50, "int64", False), ("batch_group_count", 58, "int64", False),
        ("k", 81, "int64", False), ("largest", 85, "bool", False),
        ("collective_device_list", 87, ".xla.CollectiveDeviceListProto", False),
    ],
    "HloComputationProto": [("name", 1, "string", False), ("instructions", 2, ".xla.HloInstructionProto", True),
                            ("program_shape", 4, ".xla.ProgramShapeProto", False), ("id", 5, "int64", False),
                            ("root_id", 6, "int64", False), ("is_fusion_computation", 7, "bool", False),
                            ("execution_thread", 8, "string", False)],
    "HloInputOutputAliasProto": [("entries", 1, ".xla.HloInputOutputAliasProto.AliasEntryProto", True)],
    "StackFrameIndexProto": [("file_names", 1, "string", True), ("function_names", 2, "string", True),
                             ("file_locations", 3, ".xla.StackFrameIndexProto.FileLocation", True),
                             ("stack_frames", 4, ".xla.StackFrameIndexProto.StackFrame", True)],
    "HloModuleProto": [("name", 1, "string", False), ("entry_computation_name", 2, "string", False),
                       ("computations", 3, ".xla.HloComputationProto", True),
                       ("host_program_shape", 4, ".xla.ProgramShapeProto", False), ("id", 5, "int64", False),
                       ("entry_computation_id", 6, "int64", False),
                       ("input_output_alias", 8, ".xla.HloInputOutputAliasProto", False),
                       ("is_dynamic", 11, "bool", False), ("stack_frame_index", 17, ".xla.StackFrameIndexProto", False),
                       ("frontend_attributes", 19, ".xla.FrontendAttributes", False)],
}
_NESTED = {
    "FrontendAttributes": {"MapEntry": [("key", 1, "string", False), ("value", 2, "string", False)]},
    "HloInstructionProto": {"SliceDimensions": [("start", 1, "int64", False), ("limit", 2, "int64", False),
                                                ("stride", 3, "int64", False)]},
    "HloInputOutputAliasProto": {"AliasEntryProto": [
        ("output_shape_index", 1, "int64", True), ("parameter_number", 2, "int64", False),
        ("parameter_shape_index", 3, "int64", True), ("kind", 4, ".xla.Kind", False)]},
    "StackFrameIndexProto": {
        "FileLocation": [("file_name_id", 1, "int32", False), ("function_name_id", 2, "int32", False),
                         ("line", 3, "int32", False), ("column", 4, "int32", False)],
        "StackFrame": [("file_location_id", 1, "int32", False), ("parent_frame_id", 2, "int32", False)]},
}
_ENUMS = {"PrimitiveType": PRIMITIVE_TYPES, "Kind": {"UNDEFINED_ALIAS": 0, "MAY_ALIAS": 1, "MUST_ALIAS": 2}}


def _fields(msg: descriptor_pb2.DescriptorProto, fields) -> None:
    for name, number, typ, repeated in fields:
        f = msg.field.add(name=name, number=number,
                          label=_F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL)
        if typ in _SCALARS:
            f.type = _SCALARS[typ]
        else:
            f.type_name = typ
            f.type = _F.TYPE_ENUM if typ.rsplit(".", 1)[-1] in _ENUMS else _F.TYPE_MESSAGE


def _build():
    fd = descriptor_pb2.FileDescriptorProto(name="minimax_m3/xla_hlo_subset.proto", package="xla", syntax="proto3")
    for name, values in _ENUMS.items():
        e = fd.enum_type.add(name=name)
        for k, v in values.items():
            e.value.add(name=k, number=v)
    for name, fields in _MESSAGES.items():
        msg = fd.message_type.add(name=name)
        _fields(msg, fields)
        for sub, sub_fields in _NESTED.get(name, {}).items():
            nested = msg.nested_type.add(name=sub)
            _fields(nested, sub_fields)
            if sub == "MapEntry":
                nested.options.map_entry = True
    pool = descriptor_pool.DescriptorPool()
    file_desc = pool.Add(fd)
    file_desc = pool.FindFileByName(fd.name)
    classes = {name: message_factory.GetMessageClass(file_desc.message_types_by_name[name]) for name in _MESSAGES}
    enums = {name: enum_type_wrapper.EnumTypeWrapper(file_desc.enum_types_by_name[name]) for name in _ENUMS}
    return classes, enums


_CLASSES, _ENUM_WRAPPERS = _build()
HloModuleProto = _CLASSES["HloModuleProto"]
HloComputationProto = _CLASSES["HloComputationProto"]
HloInstructionProto = _CLASSES["HloInstructionProto"]
HloInputOutputAliasProto = _CLASSES["HloInputOutputAliasProto"]
ShapeProto = _CLASSES["ShapeProto"]
OpMetadata = _CLASSES["OpMetadata"]
PrimitiveType = _ENUM_WRAPPERS["PrimitiveType"]
Kind = _ENUM_WRAPPERS["Kind"]
PRIMITIVE_TYPE_NAMES = {v: k for k, v in PRIMITIVE_TYPES.items()}


def message_classes() -> dict:
    """Every generated class by name (the stand-ins expose them as ``hlo_pb2`` / ``xla_data_pb2``)."""
    return dict(_CLASSES)


def enums() -> dict:
    return dict(_ENUM_WRAPPERS)


def parse_module(data: bytes) -> HloModuleProto:
    m = HloModuleProto()
    m.ParseFromString(data)
    return m
