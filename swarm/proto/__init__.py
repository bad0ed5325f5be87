"""Code generated from proto/*.proto by scripts/gen_proto.sh. Do not edit."""
