module github.com/epd-project/epd/bench/go_stages

go 1.19

require (
	github.com/epd-project/epd/sdk/go v0.0.0
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

// The SDK of this checkout (a user's module requires a released version instead).
replace github.com/epd-project/epd/sdk/go => ../../sdk/go
