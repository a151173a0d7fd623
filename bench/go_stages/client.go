package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	epdv1 "github.com/epd-project/epd/sdk/go/epd/v1"
	"google.golang.org/grpc"
)

// timings are one path's streams: seconds to the first message and to the end, by request.
type timings struct {
	First []float64 `json:"first_s"`
	Total []float64 `json:"total_s"`
}

// runClient times the paths in turn, request by request, so the machine's noise falls on all of
// them alike: each target's Generate (named=host:port, comma-separated), then the floor, the
// same tokens streamed straight from the stand-in decode. It prints "warm" after the warm-up,
// waits for a line on stdin (so the caller can read CPU counters around the measured part),
// then prints the timings as one JSON object, by path name ("floor" for the floor).
func runClient(targets, decodeAddress, imagePath string, warmup, requests int) error {
	image, err := os.ReadFile(imagePath)
	if err != nil {
		return err
	}
	temperature := float32(0) // greedy; unset would mean 1.0
	request := &epdv1.GenerateRequest{
		Messages: []*epdv1.ChatMessage{{Role: epdv1.Role_ROLE_USER, Parts: []*epdv1.ContentPart{
			{Content: &epdv1.ContentPart_Image{Image: &epdv1.Media{Data: image, MimeType: "image/png"}}},
			{Content: &epdv1.ContentPart_Text{Text: "Describe it."}},
		}}},
		Sampling: &epdv1.SamplingParams{MaxTokens: outputTokens, Temperature: &temperature},
	}
	type path struct {
		name     string
		generate epdv1.GatewayServiceClient
	}
	var paths []path
	for _, target := range strings.Split(targets, ",") {
		name, address, found := strings.Cut(target, "=")
		if !found {
			return fmt.Errorf("-targets wants name=host:port, got %q", target)
		}
		conn, err := grpc.Dial(address, grpc.WithInsecure())
		if err != nil {
			return err
		}
		paths = append(paths, path{name, epdv1.NewGatewayServiceClient(conn)})
	}
	conn, err := grpc.Dial(decodeAddress, grpc.WithInsecure())
	if err != nil {
		return err
	}
	decode := epdv1.NewDecodeServiceClient(conn)
	prompt := make([]uint32, 40)
	for i := range prompt {
		prompt[i] = uint32(i)
	}
	direct := &epdv1.DecodeRequest{RequestId: "direct", Prompt: &epdv1.EnginePrompt{TokenIds: prompt}, Sampling: &epdv1.SamplingParams{MaxTokens: outputTokens}}

	results := map[string]*timings{"floor": {}}
	for _, p := range paths {
		results[p.name] = &timings{}
	}
	for index := 0; index < warmup+requests; index++ {
		if index == warmup {
			fmt.Println("warm")
			if _, err := bufio.NewReader(os.Stdin).ReadString('\n'); err != nil {
				return err
			}
		}
		for _, p := range paths {
			first, total, err := timeStream(func(ctx context.Context) (func() ([]uint32, error), error) {
				stream, err := p.generate.Generate(ctx, request)
				return func() ([]uint32, error) {
					response, err := stream.Recv()
					return response.GetDelta().GetTokenIds(), err
				}, err
			})
			if err != nil {
				return fmt.Errorf("%s: %w", p.name, err)
			}
			if index >= warmup {
				results[p.name].First = append(results[p.name].First, first)
				results[p.name].Total = append(results[p.name].Total, total)
			}
		}
		first, total, err := timeStream(func(ctx context.Context) (func() ([]uint32, error), error) {
			stream, err := decode.Decode(ctx, direct)
			return func() ([]uint32, error) {
				response, err := stream.Recv()
				return response.GetTokenIds(), err
			}, err
		})
		if err != nil {
			return fmt.Errorf("floor: %w", err)
		}
		if index >= warmup {
			results["floor"].First = append(results["floor"].First, first)
			results["floor"].Total = append(results["floor"].Total, total)
		}
	}
	return json.NewEncoder(os.Stdout).Encode(results)
}

// timeStream opens a stream with open and reads it to its end: seconds to the first message and
// to the end. A stream that does not carry exactly the tokens asked for is an error.
func timeStream(open func(context.Context) (func() ([]uint32, error), error)) (float64, float64, error) {
	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	defer cancel()
	started := time.Now()
	receive, err := open(ctx)
	if err != nil {
		return 0, 0, err
	}
	var first time.Duration
	received := 0
	for {
		ids, err := receive()
		if err == io.EOF {
			break
		}
		if err != nil {
			return 0, 0, err
		}
		if first == 0 {
			first = time.Since(started)
		}
		received += len(ids)
	}
	total := time.Since(started)
	if received != outputTokens {
		return 0, 0, fmt.Errorf("streamed %d tokens, not %d", received, outputTokens)
	}
	return first.Seconds(), total.Seconds(), nil
}
