// The EPD client SDK for Node: the epd.v1 messages and service clients (ts-proto, for
// @grpc/grpc-js), generated into ./gen by scripts/gen_sdks.sh, plus the google.rpc, health
// and reflection types a client needs alongside them. One namespace per proto file, since
// every generated file exports the same helper names (protobufPackage, DeepPartial, ...).
export * as common from "./gen/epd/v1/common";
export * as decode from "./gen/epd/v1/decode";
export * as encoder from "./gen/epd/v1/encoder";
export * as engine from "./gen/epd/v1/engine";
export * as gateway from "./gen/epd/v1/gateway";
export * as multimodal from "./gen/epd/v1/multimodal";
export * as prefill from "./gen/epd/v1/prefill";
export * as rpcStatus from "./gen/google/rpc/status";
export * as errorDetails from "./gen/google/rpc/error_details";
export * as health from "./gen/grpc/health/v1/health";
export * as reflection from "./gen/grpc/reflection/v1/reflection";
export { statusDetails, type StatusDetails } from "./status";
// The SDK's own @grpc/grpc-js: clients must build credentials and metadata with the same copy
// the generated clients were made with (grpc-js checks them with instanceof).
export * as grpc from "@grpc/grpc-js";
