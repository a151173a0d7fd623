package main

import (
	"fmt"
	"sort"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	rpb "google.golang.org/grpc/reflection/grpc_reflection_v1alpha"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
)

// Server reflection as grpc.reflection.v1 and grpc.reflection.v1alpha: grpcurl, Postman and
// current gRPC libraries ask v1 first, older ones only v1alpha. The two are one protocol (the
// same messages and field numbers under two package names), so one handler serves both,
// reading and writing v1alpha's Go types. grpc-go 1.33 (Debian's) ships only v1alpha.
var reflectionServices = []string{"grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"}

func registerReflection(server *grpc.Server) {
	for _, name := range reflectionServices {
		server.RegisterService(&grpc.ServiceDesc{
			ServiceName: name,
			HandlerType: (*interface{})(nil),
			Streams: []grpc.StreamDesc{{
				StreamName:    "ServerReflectionInfo",
				ServerStreams: true,
				ClientStreams: true,
				Handler:       func(_ interface{}, stream grpc.ServerStream) error { return answerReflection(server, stream) },
			}},
		}, struct{}{})
	}
}

func answerReflection(server *grpc.Server, stream grpc.ServerStream) error {
	sent := map[string]bool{} // files already sent on this stream: a client caches them
	for {
		request := &rpb.ServerReflectionRequest{}
		if err := stream.RecvMsg(request); err != nil {
			return nil // the client closed its side (io.EOF) or went away
		}
		response := &rpb.ServerReflectionResponse{ValidHost: request.GetHost(), OriginalRequest: request}
		var file protoreflect.FileDescriptor
		var err error
		switch r := request.GetMessageRequest().(type) {
		case *rpb.ServerReflectionRequest_ListServices:
			var names []string
			for name := range server.GetServiceInfo() {
				names = append(names, name)
			}
			sort.Strings(names)
			list := &rpb.ListServiceResponse{}
			for _, name := range names {
				list.Service = append(list.Service, &rpb.ServiceResponse{Name: name})
			}
			response.MessageResponse = &rpb.ServerReflectionResponse_ListServicesResponse{ListServicesResponse: list}
		case *rpb.ServerReflectionRequest_FileByFilename:
			file, err = protoregistry.GlobalFiles.FindFileByPath(r.FileByFilename)
		case *rpb.ServerReflectionRequest_FileContainingSymbol:
			var descriptor protoreflect.Descriptor
			if descriptor, err = protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(r.FileContainingSymbol)); err == nil {
				file = descriptor.ParentFile()
			}
		default:
			err = fmt.Errorf("not supported by this server: %T", r)
		}
		if file != nil {
			files, encodeErr := withDependencies(file, sent)
			if encodeErr != nil {
				return encodeErr
			}
			response.MessageResponse = &rpb.ServerReflectionResponse_FileDescriptorResponse{FileDescriptorResponse: &rpb.FileDescriptorResponse{FileDescriptorProto: files}}
		} else if err != nil {
			response.MessageResponse = &rpb.ServerReflectionResponse_ErrorResponse{ErrorResponse: &rpb.ErrorResponse{
				ErrorCode: int32(codes.NotFound), ErrorMessage: err.Error()}}
		}
		if err := stream.SendMsg(response); err != nil {
			return err
		}
	}
}

// withDependencies: the file, then every file it imports, transitively, that this stream has
// not sent yet, each as a serialized FileDescriptorProto.
func withDependencies(file protoreflect.FileDescriptor, sent map[string]bool) ([][]byte, error) {
	var encoded [][]byte
	pending := []protoreflect.FileDescriptor{file}
	first := true
	for len(pending) > 0 {
		current := pending[0]
		pending = pending[1:]
		if sent[current.Path()] && !first {
			continue
		}
		first = false
		sent[current.Path()] = true
		bytes, err := proto.Marshal(protodesc.ToFileDescriptorProto(current))
		if err != nil {
			return nil, err
		}
		encoded = append(encoded, bytes)
		imports := current.Imports()
		for i := 0; i < imports.Len(); i++ {
			pending = append(pending, imports.Get(i).FileDescriptor)
		}
	}
	return encoded, nil
}
