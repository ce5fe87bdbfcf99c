"""Generated from proto/tokenpipe/v1/chat.proto by scripts/gen_proto.sh. Do not edit."""
