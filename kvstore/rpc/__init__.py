"""Wire API of the kvstore daemon: generated message classes (`kvstore_pb2`, from
proto/kvstore.proto by tools/gen_proto.py) and the service binding (`service`)."""
