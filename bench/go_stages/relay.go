package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"io"
	"time"

	epdv1 "github.com/epd-project/epd/sdk/go/epd/v1"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
)

// relay is the gateway's E/P/D data path and nothing else, compiled: the media to the encoder,
// the chat (a marker per item) and the encoded items to the prefill, whose first token it sends
// at once, then the token ids the prefill rendered, that first token after them and the KV
// handoff to the decode, whose stream it relays message by message, then a Finished with the
// usage and stage timings. One instance per stage; no validation beyond the
// stages' own, no routing, retries, health, TLS, auth, spans or metrics. It is a measuring
// instrument, not a gateway: what EPD's hops cost a compiled gRPC runtime, against stand-ins
// (bench/gateway_overhead.py) and against real stages (the serving experiments' epd-go-relay
// arm). Its tokens must still equal monolithic's there.
type relay struct {
	epdv1.UnimplementedGatewayServiceServer
	encoder epdv1.EncoderServiceClient
	prefill epdv1.PrefillServiceClient
	decode  epdv1.DecodeServiceClient
}

func newRelay(encoderAddress, prefillAddress, decodeAddress string) (*relay, error) {
	dial := func(address string) (*grpc.ClientConn, error) { return grpc.Dial(address, grpc.WithInsecure()) }
	encoder, err := dial(encoderAddress)
	if err != nil {
		return nil, err
	}
	prefill, err := dial(prefillAddress)
	if err != nil {
		return nil, err
	}
	decode, err := dial(decodeAddress)
	if err != nil {
		return nil, err
	}
	return &relay{
		encoder: epdv1.NewEncoderServiceClient(encoder),
		prefill: epdv1.NewPrefillServiceClient(prefill),
		decode:  epdv1.NewDecodeServiceClient(decode),
	}, nil
}

// engineChat splits the public chat into what the engines get (text, and a marker where each
// item goes) and the media items for the encoder, in order.
func engineChat(messages []*epdv1.ChatMessage) ([]*epdv1.EngineChatMessage, []*epdv1.MediaItem) {
	chat := make([]*epdv1.EngineChatMessage, 0, len(messages))
	var media []*epdv1.MediaItem
	marker := func(modality epdv1.Modality) *epdv1.EngineChatPart {
		return &epdv1.EngineChatPart{Content: &epdv1.EngineChatPart_Item{Item: modality}}
	}
	for _, message := range messages {
		role := message.GetRole()
		if role == epdv1.Role_ROLE_UNSPECIFIED {
			role = epdv1.Role_ROLE_USER // as the gateway reads it
		}
		parts := make([]*epdv1.EngineChatPart, 0, len(message.GetParts()))
		for _, part := range message.GetParts() {
			switch content := part.GetContent().(type) {
			case *epdv1.ContentPart_Text:
				parts = append(parts, &epdv1.EngineChatPart{Content: &epdv1.EngineChatPart_Text{Text: content.Text}})
			case *epdv1.ContentPart_Image:
				media = append(media, &epdv1.MediaItem{Media: &epdv1.MediaItem_Image{Image: content.Image}})
				parts = append(parts, marker(epdv1.Modality_MODALITY_IMAGE))
			case *epdv1.ContentPart_Video:
				media = append(media, &epdv1.MediaItem{Media: &epdv1.MediaItem_Video{Video: content.Video}})
				parts = append(parts, marker(epdv1.Modality_MODALITY_VIDEO))
			case *epdv1.ContentPart_Audio:
				media = append(media, &epdv1.MediaItem{Media: &epdv1.MediaItem_Audio{Audio: content.Audio}})
				parts = append(parts, marker(epdv1.Modality_MODALITY_AUDIO))
			}
		}
		chat = append(chat, &epdv1.EngineChatMessage{Role: role, Parts: parts})
	}
	return chat, media
}

func (r *relay) Generate(request *epdv1.GenerateRequest, stream epdv1.GatewayService_GenerateServer) error {
	start := time.Now()
	ctx, cancel := context.WithTimeout(stream.Context(), callTimeout)
	defer cancel()
	chat, media := engineChat(request.GetMessages())
	timings := &epdv1.StageTimings{}
	var items []*epdv1.EncodedItem
	var multimodalTokens uint32
	releaseKey := ""
	if len(media) > 0 {
		releaseKey = newReleaseKey()
		started := time.Now()
		encoded, err := r.encoder.Encode(ctx, &epdv1.EncodeRequest{RequestId: request.GetRequestId(), Items: media, ReleaseKey: releaseKey})
		if err != nil {
			r.releaseLeases(releaseKey)
			return err
		}
		timings.Encode = durationpb.New(time.Since(started))
		items = encoded.GetItems()
		needsMedia := false
		for _, item := range items {
			multimodalTokens += item.GetMetadata().GetPlaceholderLength()
			needsMedia = needsMedia || item.GetMetadata().GetLayoutNeedsMedia()
		}
		if needsMedia { // as the gateway: one item that needs its media sends all
			for i, item := range items {
				item.ForwardedMedia = media[i]
			}
		}
	}
	started := time.Now()
	prefilled, err := r.prefill.Prefill(ctx, &epdv1.PrefillRequest{
		RequestId: request.GetRequestId(),
		Prompt:    &epdv1.EnginePrompt{Chat: chat},
		Items:     items,
		Sampling:  request.GetSampling(),
	})
	if err != nil {
		r.releaseLeases(releaseKey)
		return err
	}
	timings.Prefill = durationpb.New(time.Since(started))
	timings.TimeToFirstToken = durationpb.New(time.Since(start))
	finished := &epdv1.GenerateFinished{
		Usage:   &epdv1.Usage{PromptTokens: prefilled.GetPromptTokenCount(), CompletionTokens: 1, MultimodalTokens: multimodalTokens},
		Timings: timings,
	}
	first := &epdv1.GenerateDelta{TokenIds: []uint32{prefilled.GetFirstTokenId()}, Text: prefilled.GetFirstTokenText()}
	if err := stream.Send(&epdv1.GenerateResponse{Event: &epdv1.GenerateResponse_Delta{Delta: first}}); err != nil {
		r.releaseKv(request.GetRequestId(), prefilled.GetKvHandoff())
		return err
	}
	if reason := prefilled.GetFinishReason(); reason != epdv1.FinishReason_FINISH_REASON_UNSPECIFIED {
		// The reply ended with its first token: no decode reads the KV.
		r.releaseKv(request.GetRequestId(), prefilled.GetKvHandoff())
		finished.FinishReason = reason
		timings.Total = durationpb.New(time.Since(start))
		return stream.Send(&epdv1.GenerateResponse{Event: &epdv1.GenerateResponse_Finished{Finished: finished}})
	}
	// The decode goes on after the first token, with what is left of the budget.
	sampling := proto.Clone(request.GetSampling()).(*epdv1.SamplingParams)
	sampling.MaxTokens--
	if sampling.GetMinTokens() > 0 {
		sampling.MinTokens = proto.Uint32(sampling.GetMinTokens() - 1)
	}
	metadataOnly := make([]*epdv1.EncodedItem, len(items))
	for i, item := range items {
		metadataOnly[i] = &epdv1.EncodedItem{Metadata: item.GetMetadata(), ForwardedMedia: item.GetForwardedMedia()}
	}
	started = time.Now()
	decoding, err := r.decode.Decode(ctx, &epdv1.DecodeRequest{
		RequestId: request.GetRequestId(),
		Prompt:    &epdv1.EnginePrompt{TokenIds: prefilled.GetPromptTokenIds(), ContinuationTokenIds: first.TokenIds},
		Items:     metadataOnly,
		Sampling:  sampling,
		KvHandoff: prefilled.GetKvHandoff(),
	})
	if err != nil {
		r.releaseKv(request.GetRequestId(), prefilled.GetKvHandoff())
		return err
	}
	answered := false
	for {
		message, err := decoding.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			if !answered {
				r.releaseKv(request.GetRequestId(), prefilled.GetKvHandoff())
			}
			return err
		}
		answered = true
		if len(message.GetTokenIds()) > 0 {
			finished.Usage.CompletionTokens += uint32(len(message.GetTokenIds()))
			delta := &epdv1.GenerateDelta{TokenIds: message.GetTokenIds(), Text: message.GetText()}
			if err := stream.Send(&epdv1.GenerateResponse{Event: &epdv1.GenerateResponse_Delta{Delta: delta}}); err != nil {
				return err
			}
		}
		if message.GetFinishReason() != epdv1.FinishReason_FINISH_REASON_UNSPECIFIED {
			finished.FinishReason = message.GetFinishReason()
		}
	}
	timings.Decode = durationpb.New(time.Since(started))
	timings.Total = durationpb.New(time.Since(start))
	return stream.Send(&epdv1.GenerateResponse{Event: &epdv1.GenerateResponse_Finished{Finished: finished}})
}

// releaseLeases frees the embedding leases of a request that failed (idempotent: a prefill
// that read them has freed them already).
func (r *relay) releaseLeases(key string) {
	if key == "" {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, _ = r.encoder.ReleaseEmbeddings(ctx, &epdv1.ReleaseEmbeddingsRequest{ReleaseKeys: []string{key}}) // best effort: the lease's TTL frees them otherwise
}

// releaseKv frees KV that no decode read.
func (r *relay) releaseKv(requestID string, handoff *epdv1.KvHandoff) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, _ = r.decode.ReleaseKv(ctx, &epdv1.ReleaseKvRequest{RequestId: requestID, KvHandoff: handoff}) // best effort: the prefill's KV lease frees it otherwise
}

func newReleaseKey() string {
	key := make([]byte, 16)
	if _, err := rand.Read(key); err != nil {
		panic(err)
	}
	return hex.EncodeToString(key)
}
