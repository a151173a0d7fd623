// Command go_stages serves bench/gateway_overhead.py's compiled parts, in grpc-go:
//
//	go_stages -role stages                  stand-in encoder, prefill and decode that answer at once
//	go_stages -role relay -encoder HOST:PORT -prefill HOST:PORT -decode HOST:PORT
//	                                        EPD's E/P/D data path alone (relay.go)
//	go_stages -role client -targets gateway=HOST:PORT,... -decode HOST:PORT -image FILE
//	                                        the timing client (client.go)
//	go_stages -role load -target HOST:PORT -request-file FILE [-offsets S,...] [-max-concurrency N]
//	                                        the serving experiments' client (load.go)
//
// The servers print the port they listen on, then serve until killed.
//
// The stand-ins do no work, and being compiled they cost next to nothing per call, so what the
// benchmark measures through the gateway is the gateway's own work and its hops, not a Python
// server's. The relay speaks the stages' real protocol with none of the gateway's other work
// (relay.go), so it runs against the stand-ins and against real stages alike: what EPD's hops
// cost a compiled gRPC runtime. The client is compiled for the same reason: a grpc.aio client
// spends Python on every message it reads, and that cost, which differs with what ran just
// before, would fall unevenly on the paths it times.
package main

import (
	"context"
	"flag"
	"fmt"
	"net"
	"os"
	"strings"
	"time"

	epdv1 "github.com/epd-project/epd/sdk/go/epd/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
)

// What the Python stand-ins answered before: one item of 16 placeholders, 64 wide, and
// 16 output tokens, one per message.
const (
	placeholders = 16
	width        = 64
	outputTokens = 16
	promptTokens = 40 // what the stand-in prefill renders a chat to (the grpc.aio relay's prompt)
	callTimeout  = 30 * time.Second
)

type encoder struct {
	epdv1.UnimplementedEncoderServiceServer
}

func (encoder) Encode(_ context.Context, request *epdv1.EncodeRequest) (*epdv1.EncodeResponse, error) {
	items := make([]*epdv1.EncodedItem, 0, len(request.GetItems()))
	for _, item := range request.GetItems() {
		hash := item.GetContentHash()
		if hash == "" {
			hash = strings.Repeat("0", 64)
		}
		metadata := &epdv1.MultimodalMetadata{
			Modality:           epdv1.Modality_MODALITY_IMAGE,
			ContentHash:        hash,
			PlaceholderTokenId: 151655,
			PlaceholderCount:   placeholders,
			PlaceholderLength:  placeholders,
			GridThw:            &epdv1.GridThw{T: 1, H: 8, W: 8},
			EmbeddingShape:     []uint64{placeholders, width},
			EmbeddingDtype:     epdv1.TensorDtype_TENSOR_DTYPE_FLOAT32,
		}
		embedding := &epdv1.EmbeddingHandle{Transport: &epdv1.EmbeddingHandle_Inline{Inline: &epdv1.InlineEmbedding{Data: make([]byte, placeholders*width*4)}}}
		items = append(items, &epdv1.EncodedItem{Metadata: metadata, Embedding: embedding})
	}
	return &epdv1.EncodeResponse{Items: items}, nil
}

func (encoder) ReleaseEmbeddings(_ context.Context, request *epdv1.ReleaseEmbeddingsRequest) (*epdv1.ReleaseEmbeddingsResponse, error) {
	return &epdv1.ReleaseEmbeddingsResponse{ReleasedCount: uint32(len(request.GetLeaseIds()))}, nil
}

func (encoder) GetTransferMetadata(context.Context, *epdv1.GetTransferMetadataRequest) (*epdv1.GetTransferMetadataResponse, error) {
	// Inline embeddings need no NIXL agent; a consumer asking for one is a bug in the bench.
	return nil, status.Error(codes.FailedPrecondition, "the stand-in encoder publishes inline embeddings only")
}

type prefill struct {
	epdv1.UnimplementedPrefillServiceServer
}

func (prefill) Prefill(_ context.Context, request *epdv1.PrefillRequest) (*epdv1.PrefillResponse, error) {
	// A real prefill renders the chat it is sent and returns the token ids it ran; the stand-in
	// returns promptTokens ids in place of the rendering.
	ids := request.GetPrompt().GetTokenIds()
	if len(ids) == 0 {
		ids = make([]uint32, promptTokens)
	}
	count := uint32(len(ids))
	blocks := make([]uint32, 0, count/16+1)
	for id := uint32(1); id < count/16+2; id++ {
		blocks = append(blocks, id)
	}
	handoff := &epdv1.KvHandoff{
		RemoteEngineId:    "stand-in",
		RemoteBlockGroups: []*epdv1.KvBlockGroup{{BlockIds: blocks}},
		RemoteHost:        "127.0.0.1",
		RemotePort:        1,
		RemoteRequestId:   request.GetRequestId(),
		RemoteNumTokens:   count,
		TpSize:            1,
	}
	return &epdv1.PrefillResponse{FirstTokenId: 99, FirstTokenText: "x", KvHandoff: handoff, PromptTokenCount: count, PromptTokenIds: ids}, nil
}

type decode struct {
	epdv1.UnimplementedDecodeServiceServer
}

func (decode) Decode(request *epdv1.DecodeRequest, stream epdv1.DecodeService_DecodeServer) error {
	// After a prefill, the decode goes on from the prefill's first token: the reply still has
	// outputTokens in all.
	for index := len(request.GetPrompt().GetContinuationTokenIds()); index < outputTokens; index++ {
		finish := epdv1.FinishReason_FINISH_REASON_UNSPECIFIED
		if index == outputTokens-1 {
			finish = epdv1.FinishReason_FINISH_REASON_LENGTH
		}
		message := &epdv1.DecodeResponse{
			TokenIds:         []uint32{uint32(100 + index)},
			Text:             "x",
			FinishReason:     finish,
			PromptTokenCount: uint32(len(request.GetPrompt().GetTokenIds()) + len(request.GetPrompt().GetContinuationTokenIds())),
		}
		if err := stream.Send(message); err != nil {
			return err
		}
	}
	return nil
}

func (decode) ReleaseKv(context.Context, *epdv1.ReleaseKvRequest) (*epdv1.ReleaseKvResponse, error) {
	return &epdv1.ReleaseKvResponse{}, nil
}

func main() {
	role := flag.String("role", "", "stages, relay, client or load")
	encoderAddress := flag.String("encoder", "", "for the relay: the encoder's address (host:port)")
	prefillAddress := flag.String("prefill", "", "for the relay: the prefill's address")
	decodeAddress := flag.String("decode", "", "for the relay: the decode's address; for the client: the stand-in decode's, the floor")
	targets := flag.String("targets", "", "for the client: the GatewayService paths to time, name=host:port,...")
	image := flag.String("image", "", "for the client: the PNG each request carries")
	warmup := flag.Int("warmup", 20, "for the client: requests per path before timing")
	requests := flag.Int("requests", 300, "for the client: timed requests per path")
	target := flag.String("target", "", "for the load: the GatewayService address")
	requestFile := flag.String("request-file", "", "for the load: the requests, each after its length (4 bytes, big-endian)")
	offsets := flag.String("offsets", "", "for the load: each request's send time, seconds from the start, comma-separated (empty: all at once)")
	maxConcurrency := flag.Int("max-concurrency", 0, "for the load: requests in flight at most (0: no limit)")
	flag.Parse()
	switch *role {
	case "client":
		exitIf(runClient(*targets, *decodeAddress, *image, *warmup, *requests))
		return
	case "load":
		exitIf(runLoad(*target, *requestFile, *offsets, *maxConcurrency))
		return
	}
	server := grpc.NewServer()
	switch *role {
	case "stages":
		epdv1.RegisterEncoderServiceServer(server, encoder{})
		epdv1.RegisterPrefillServiceServer(server, prefill{})
		epdv1.RegisterDecodeServiceServer(server, decode{})
		// The gateway routes only to instances whose health says SERVING.
		healthServer := health.NewServer()
		for _, name := range []string{"epd.v1.EncoderService", "epd.v1.PrefillService", "epd.v1.DecodeService"} {
			healthServer.SetServingStatus(name, healthpb.HealthCheckResponse_SERVING)
		}
		healthpb.RegisterHealthServer(server, healthServer)
	case "relay":
		relay, err := newRelay(*encoderAddress, *prefillAddress, *decodeAddress)
		exitIf(err)
		epdv1.RegisterGatewayServiceServer(server, relay)
	default:
		exitIf(fmt.Errorf("-role must be stages, relay, client or load, got %q", *role))
	}
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	exitIf(err)
	fmt.Println(listener.Addr().(*net.TCPAddr).Port)
	exitIf(server.Serve(listener))
}

func exitIf(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
}
