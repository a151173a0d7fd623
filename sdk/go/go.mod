// The Go SDK of epd.v1: scripts/gen_sdks.sh generates its code into epd/v1 (never committed).
// Versions are grpc-go 1.33.3 and protobuf-go 1.28.1, what the generators (Debian 12's
// protoc-gen-go 1.28.1, protoc-gen-go-grpc of grpc-go 1.33.3) write code for.
module github.com/epd-project/epd/sdk/go

go 1.19

require (
	google.golang.org/grpc v1.33.3
	google.golang.org/protobuf v1.28.1
)

require (
	github.com/golang/protobuf v1.5.2 // indirect
	golang.org/x/net v0.7.0 // indirect
	golang.org/x/sys v0.5.0 // indirect
	golang.org/x/text v0.7.0 // indirect
	google.golang.org/genproto v0.0.0-20200526211855-cb27e3aa2013 // indirect
)
