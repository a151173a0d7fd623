// Command epd-generate streams one image request from an EPD gateway with the generated Go SDK
// (sdk/go, built by scripts/gen_sdks.sh) and prints the reply, or the status with its
// google.rpc.BadRequest field violations.
//
//	epd-generate -gateway 127.0.0.1:50051 -image cat.png -prompt "Describe this"
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"mime"
	"os"
	"path/filepath"
	"time"

	epdv1 "github.com/epd-project/epd/sdk/go/epd/v1"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
)

func main() {
	gateway := flag.String("gateway", "127.0.0.1:50051", "gateway address (host:port)")
	image := flag.String("image", "", "image file to send (PNG, JPEG, WebP, ...)")
	prompt := flag.String("prompt", "Describe this image.", "text after the image")
	maxTokens := flag.Uint("max-tokens", 32, "tokens to generate at most")
	timeout := flag.Duration("timeout", 2*time.Minute, "deadline for the whole call")
	flag.Parse()
	if err := run(*gateway, *image, *prompt, uint32(*maxTokens), *timeout); err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
}

func run(address, image, prompt string, maxTokens uint32, timeout time.Duration) error {
	parts := []*epdv1.ContentPart{}
	if image != "" {
		data, err := os.ReadFile(image)
		if err != nil {
			return err
		}
		media := &epdv1.Media{Data: data, MimeType: mime.TypeByExtension(filepath.Ext(image))}
		parts = append(parts, &epdv1.ContentPart{Content: &epdv1.ContentPart_Image{Image: media}})
	}
	parts = append(parts, &epdv1.ContentPart{Content: &epdv1.ContentPart_Text{Text: prompt}})
	temperature := float32(0) // greedy; unset would mean 1.0
	request := &epdv1.GenerateRequest{
		Messages: []*epdv1.ChatMessage{{Role: epdv1.Role_ROLE_USER, Parts: parts}},
		Sampling: &epdv1.SamplingParams{MaxTokens: maxTokens, Temperature: &temperature},
	}

	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	// Plaintext, as `epd up` serves on loopback; use grpc.WithTransportCredentials for TLS.
	conn, err := grpc.DialContext(ctx, address, grpc.WithInsecure())
	if err != nil {
		return err
	}
	defer conn.Close()
	stream, err := epdv1.NewGatewayServiceClient(conn).Generate(ctx, request)
	if err != nil {
		return describe(err)
	}
	for {
		response, err := stream.Recv()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return describe(err)
		}
		switch event := response.Event.(type) {
		case *epdv1.GenerateResponse_Delta:
			fmt.Print(event.Delta.Text)
		case *epdv1.GenerateResponse_Finished:
			usage := event.Finished.Usage
			fmt.Printf("\n[finish=%s prompt_tokens=%d completion_tokens=%d]\n", event.Finished.FinishReason, usage.GetPromptTokens(), usage.GetCompletionTokens())
		}
	}
}

// describe turns a failed call into its code, message and typed details.
func describe(err error) error {
	st := status.Convert(err)
	text := fmt.Sprintf("%s: %s", st.Code(), st.Message())
	for _, detail := range st.Details() {
		switch d := detail.(type) {
		case *errdetails.BadRequest:
			for _, v := range d.GetFieldViolations() {
				text += fmt.Sprintf("\n  %s: %s", v.GetField(), v.GetDescription())
			}
		case *errdetails.RetryInfo:
			delay := d.GetRetryDelay() // Debian's genproto predates durationpb.AsDuration
			text += fmt.Sprintf("\n  retry after %s", time.Duration(delay.GetSeconds())*time.Second+time.Duration(delay.GetNanos()))
		}
	}
	return fmt.Errorf("%s", text)
}
