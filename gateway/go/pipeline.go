package main

import (
	"context"
	"fmt"
	"io"
	"log"
	"math/rand"
	"sync"
	"time"

	epdv1 "epd/sdk/go/epd/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/durationpb"
)

// How the gateway serves one request: encoder -> prefill -> decode (E/P/D), or encoder -> a
// decode instance that prefills itself (E+PD). Prefill and decode get metadata, never media (but
// for a modality the model has no metadata-only layout for, or under --forward-media). The
// gateway knows no model: the engine that prefills renders the chat.

const (
	releaseTimeout  = 5 * time.Second
	releaseAttempts = 2                // a KV release tries another decode instance once
	statusAfterEnd  = 10 * time.Second // how long a decode call is read for its status after its last message
)

// retryPolicy: how a request whose stage call failed before the first token is retried.
type retryPolicy struct {
	maxAttempts int           // per request, the first try included
	backoff     time.Duration // doubles per attempt, with full jitter; the deadline caps it
}

func (r retryPolicy) delay(attempt int) time.Duration {
	return time.Duration(rand.Float64() * float64(r.backoff) * float64(int(1)<<(attempt-1)))
}

type pipeline struct {
	limits               mediaLimits
	maxPromptBytes       int
	forwardMedia         bool // the benchmarks' baseline: later stages get every item's media
	localPrefillFallback bool // with no live prefill instance, a decode instance prefills (E+PD)
	retry                retryPolicy
	encoders             *pool
	prefills             *pool // nil in E+PD (--mode epd-combined)
	decodes              *pool
	keys                 *affinityKeys
	metrics              *metrics
}

// clock: one request's progress, its times and token counts so far. The servicer reads it when
// Abort ends the request, so an aborted stream still reports what was done.
type clock struct {
	m                *metrics
	start            time.Time
	encode, prefill  time.Duration
	decodeStarted    time.Time
	decode           time.Duration
	ttft             time.Duration
	total            time.Duration // set by finished; record observes the same figure the reply reported
	lastToken        time.Time
	tokens           uint32
	promptTokens     uint32 // the expanded prompt, once the engine that decodes has it
	multimodalTokens uint32
}

func (c *clock) token(count int) {
	now := time.Now()
	if c.lastToken.IsZero() {
		c.ttft = now.Sub(c.start)
		c.m.ttft.observe(c.ttft.Seconds())
	} else {
		c.m.itl.observe(now.Sub(c.lastToken).Seconds())
	}
	c.lastToken = now
	c.tokens += uint32(count)
}

// finished: the request's last message; a decode still running counts until now.
func (c *clock) finished(reason epdv1.FinishReason) *epdv1.GenerateFinished {
	c.total = time.Since(c.start)
	decode := c.decode
	if !c.decodeStarted.IsZero() && decode == 0 {
		decode = time.Since(c.decodeStarted)
	}
	return &epdv1.GenerateFinished{
		FinishReason: reason,
		Usage:        &epdv1.Usage{PromptTokens: c.promptTokens, CompletionTokens: c.tokens, MultimodalTokens: c.multimodalTokens},
		Timings: &epdv1.StageTimings{
			Encode: durationpb.New(c.encode), Prefill: durationpb.New(c.prefill), Decode: durationpb.New(decode),
			TimeToFirstToken: durationpb.New(c.ttft), Total: durationpb.New(c.total),
		},
	}
}

// record observes a completed request's latencies, as finished reported them.
func (c *clock) record() {
	total := c.total
	c.m.e2el.observe(total.Seconds())
	c.m.gatewayOwn.observe((total - c.encode - c.prefill - c.decode).Seconds())
	if c.tokens > 1 {
		c.m.tpot.observe((total - c.ttft).Seconds() / float64(c.tokens-1))
	}
	for stage, spent := range map[string]time.Duration{"encode": c.encode, "prefill": c.prefill, "decode": c.decode} {
		if spent > 0 {
			c.m.stageSeconds.observe(spent.Seconds(), stage)
		}
	}
}

// sendFunc hands a message to the client's stream (it never blocks: see run.go).
type sendFunc func(*epdv1.GenerateResponse)

// generate runs the request, retrying it from the encoder on other instances when a stage
// fails before the first token; after the first token a failure ends the stream, saying how
// many tokens were sent.
func (p *pipeline) generate(ctx context.Context, r *request, c *clock, send sendFunc) *requestError {
	avoid := map[string]bool{}
	for attempt := 1; ; attempt++ {
		err := p.attempt(ctx, r, c, avoid, send)
		if err == nil || (err.code != codes.Unavailable && err.code != codes.Aborted) {
			return err
		}
		// Aborted: the prefill's KV lease ran out before a decode took it (a busy host); no
		// instance is to blame, so none is avoided on the next try.
		if c.tokens > 0 {
			return newError(codes.Unavailable, "%s (after %d tokens were sent)", err.message, c.tokens)
		}
		delay := p.retry.delay(attempt)
		deadline, hasDeadline := ctx.Deadline()
		if attempt >= p.retry.maxAttempts || (hasDeadline && time.Until(deadline) <= delay) {
			return err
		}
		stage := err.stage
		switch {
		case err.code == codes.Aborted:
			stage = "kv_lease"
		case stage == "":
			stage = "routing"
		}
		for _, suspect := range err.suspects {
			avoid[suspect] = true
		}
		log.Printf("WARNING request %s: attempt %d failed before its first token (%s); retrying", r.id, attempt, err.message)
		p.metrics.retries.inc(stage)
		select {
		case <-ctx.Done():
			return err
		case <-time.After(delay):
		}
	}
}

// attempt is one try of the whole request. On failure it frees what the try left behind: the
// encoders' leases nobody read, and KV no decode has read, so neither waits for its TTL.
func (p *pipeline) attempt(ctx context.Context, r *request, c *clock, avoid map[string]bool, send sendFunc) (failure *requestError) {
	leases := map[string][]string{} // encoder address -> the release keys of its calls
	var handoff *epdv1.KvHandoff
	decodeAnswered := false // its engine has read the KV: vLLM frees it from here on
	defer func() {
		if failure != nil {
			p.releaseLeases(leases)
			if handoff != nil && !decodeAnswered {
				p.releaseKv(r.id, handoff, avoid)
			}
		}
	}()
	var items []*epdv1.EncodedItem
	if len(r.media) > 0 {
		started := time.Now()
		var err *requestError
		if items, err = p.encode(ctx, r, leases, avoid); err != nil {
			return err
		}
		c.encode = time.Since(started)
		c.multimodalTokens = 0
		for _, item := range items {
			c.multimodalTokens += item.GetMetadata().GetPlaceholderLength()
		}
	}
	needsMedia := p.forwardMedia
	for _, item := range items {
		needsMedia = needsMedia || item.GetMetadata().GetLayoutNeedsMedia()
	}
	if needsMedia {
		// vLLM cannot mix metadata-only and raw items in one prompt (its processor then misses
		// the metadata-only ones), so one item that needs its media sends all.
		for i, item := range items {
			item.ForwardedMedia = r.media[i].item
		}
	}
	decodeRequest := &epdv1.DecodeRequest{RequestId: r.id, Prompt: &epdv1.EnginePrompt{Chat: r.chat}, Items: items, Sampling: r.sampling}
	prefillAddress := "" // the instance holding the handoff's KV
	if p.prefills != nil && !p.prefillOnDecode(r.id) {
		started := time.Now()
		prefilled, address, err := p.prefill(ctx, r, items, avoid)
		if err != nil {
			return err
		}
		handoff, prefillAddress = prefilled.GetKvHandoff(), address
		c.prefill = time.Since(started)
		// The decode runs the very token ids whose KV the prefill left, and gets metadata only.
		metadataOnly := make([]*epdv1.EncodedItem, len(items))
		for i, item := range items {
			metadataOnly[i] = &epdv1.EncodedItem{Metadata: item.GetMetadata(), ForwardedMedia: item.GetForwardedMedia()}
		}
		decodeRequest.Prompt = &epdv1.EnginePrompt{TokenIds: prefilled.GetPromptTokenIds()}
		decodeRequest.Items = metadataOnly
		decodeRequest.KvHandoff = handoff
	}
	c.decodeStarted = time.Now()
	err := p.decode(ctx, decodeRequest, c, avoid, send, func() { decodeAnswered = true })
	if err != nil && err.stageFailed() && prefillAddress != "" && !decodeAnswered {
		// A decode that fails before answering most often could not pull the KV: the prefill
		// holding it may be the instance that is gone, not the decode.
		err.suspects = append(err.suspects, prefillAddress)
	}
	return err
}

// prefillOnDecode: whether this E/P/D request goes to decode without a KV handoff, to be
// prefilled there: only under the local-prefill fallback, while no prefill instance is live (a
// failed one is ejected at once, so the request's retry lands here).
func (p *pipeline) prefillOnDecode(requestID string) bool {
	if !p.localPrefillFallback || p.prefills.available() {
		return false
	}
	log.Printf("WARNING request %s: no live prefill instance; a decode instance prefills it (--local-prefill-fallback)", requestID)
	p.metrics.localPrefills.inc()
	return true
}

// encode encodes the items over the encoder instances (one call per chosen instance, in
// parallel), in order. Each item goes to the encoder that last served it, else where its key
// points (that encoder's cache may hold its output already); instances in avoid only as a last
// resort. Every call's release key is recorded before it goes out: it frees the call's leases
// even when its reply never arrives.
func (p *pipeline) encode(ctx context.Context, r *request, leases map[string][]string, avoid map[string]bool) ([]*epdv1.EncodedItem, *requestError) {
	type group struct {
		address    string
		indices    []int
		releaseKey string
	}
	var groups []*group
	byAddress := map[string]*group{}
	keys := make([]uint64, len(r.media))
	for i, m := range r.media {
		keys[i] = p.keys.item(m.item)
		address, err := p.encoders.pickForKey(keys[i], avoid)
		if err != nil {
			return nil, err
		}
		if byAddress[address] == nil {
			byAddress[address] = &group{address: address, releaseKey: newRequestID()}
			groups = append(groups, byAddress[address])
			leases[address] = append(leases[address], byAddress[address].releaseKey)
		}
		byAddress[address].indices = append(byAddress[address].indices, i)
	}
	results := make([]*epdv1.EncodedItem, len(r.media))
	failures := make([]*requestError, len(groups))
	var wg sync.WaitGroup
	for gi, g := range groups {
		wg.Add(1)
		go func(gi int, g *group) {
			defer wg.Done()
			conn, done, err := p.encoders.acquire(g.address)
			if err != nil {
				failures[gi] = err
				return
			}
			defer done()
			message := &epdv1.EncodeRequest{RequestId: r.id, ReleaseKey: g.releaseKey}
			paths := make([]string, len(g.indices))
			for k, i := range g.indices {
				message.Items = append(message.Items, r.media[i].item)
				paths[k] = r.media[i].path
			}
			callCtx, callSpan := startClientSpan(ctx, "encode")
			response, callErr := epdv1.NewEncoderServiceClient(conn).Encode(callCtx, message)
			if callErr != nil {
				failures[gi] = remapItemFields(fromStageError(ctx, p.encoders, g.address, callErr), paths)
				callSpan.finish(failures[gi])
				return
			}
			callSpan.finish(nil)
			if len(response.GetItems()) != len(g.indices) {
				failures[gi] = newError(codes.Internal, "encoder %s answered %d items for %d", g.address, len(response.GetItems()), len(g.indices))
				return
			}
			for k, i := range g.indices {
				results[i] = response.GetItems()[k]
			}
		}(gi, g)
	}
	wg.Wait() // every call finishes before any failure is reported: none runs on for a request that ended
	for _, failure := range failures {
		if failure != nil {
			return nil, failure
		}
	}
	for _, g := range groups { // their arenas hold the outputs now, and answer a repeat without the engine
		for _, i := range g.indices {
			p.encoders.recordHolder(keys[i], g.address)
		}
	}
	return results, nil
}

func (p *pipeline) prefill(ctx context.Context, r *request, items []*epdv1.EncodedItem, avoid map[string]bool) (*epdv1.PrefillResponse, string, *requestError) {
	firstItemHash := ""
	if len(items) > 0 {
		firstItemHash = items[0].GetMetadata().GetContentHash()
	}
	address, err := p.prefills.pickForKey(p.keys.prefix(r.chat, firstItemHash), avoid)
	if err != nil {
		return nil, "", err
	}
	conn, done, err := p.prefills.acquire(address)
	if err != nil {
		return nil, "", err
	}
	defer done()
	callCtx, callSpan := startClientSpan(ctx, "prefill")
	response, callErr := epdv1.NewPrefillServiceClient(conn).Prefill(callCtx, &epdv1.PrefillRequest{
		RequestId: r.id, Prompt: &epdv1.EnginePrompt{Chat: r.chat}, Items: items, Sampling: r.sampling,
	})
	if callErr != nil {
		err := enginePromptError(p.prefills, address, fromStageError(ctx, p.prefills, address, callErr))
		callSpan.finish(err)
		return nil, "", err
	}
	callSpan.finish(nil)
	return response, address, nil
}

// decode streams the decode stage's tokens to the client, then the Finished message.
//
// After the last message the call is still read to its status rather than cancelled: a call
// cancelled there ends on the decode as CANCELLED, not as the success it was. The client has
// its reply by then, so this wait is bounded but unhurried.
func (p *pipeline) decode(ctx context.Context, message *epdv1.DecodeRequest, c *clock, avoid map[string]bool, send sendFunc, answered func()) *requestError {
	address, err := p.decodes.pick(avoid)
	if err != nil {
		return err
	}
	conn, done, err := p.decodes.acquire(address)
	if err != nil {
		return err
	}
	defer done()
	callCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	callCtx, callSpan := startClientSpan(callCtx, "decode")
	failure := p.relayDecode(ctx, callCtx, cancel, conn, address, message, c, send, answered)
	callSpan.finish(failure)
	return failure
}

func (p *pipeline) relayDecode(ctx, callCtx context.Context, cancel context.CancelFunc, conn *grpc.ClientConn, address string, message *epdv1.DecodeRequest, c *clock, send sendFunc, answered func()) *requestError {
	stream, callErr := epdv1.NewDecodeServiceClient(conn).Decode(callCtx, message)
	for callErr == nil {
		var response *epdv1.DecodeResponse
		if response, callErr = stream.Recv(); callErr != nil {
			break
		}
		answered()
		c.promptTokens = response.GetPromptTokenCount()
		if len(response.GetTokenIds()) > 0 {
			c.token(len(response.GetTokenIds()))
			delta := &epdv1.GenerateDelta{TokenIds: response.GetTokenIds(), Text: response.GetText()}
			send(&epdv1.GenerateResponse{Event: &epdv1.GenerateResponse_Delta{Delta: delta}})
		}
		if reason := response.GetFinishReason(); reason != epdv1.FinishReason_FINISH_REASON_UNSPECIFIED {
			c.decode = time.Since(c.decodeStarted)
			finished := c.finished(reason)
			c.record()
			send(&epdv1.GenerateResponse{Event: &epdv1.GenerateResponse_Finished{Finished: finished}})
			readToStatus(stream, address, cancel)
			return nil
		}
	}
	if callErr == io.EOF {
		return &requestError{code: codes.Unavailable, message: fmt.Sprintf("decode %s ended its stream without a finish reason", address),
			stage: "decode", suspects: []string{address}}
	}
	return enginePromptError(p.decodes, address, fromStageError(ctx, p.decodes, address, callErr))
}

// readToStatus waits for a decode call's status after its last message, for at most
// statusAfterEnd (then cancel ends it). The reply is complete and delivered, so a status that
// fails now fails nothing.
func readToStatus(stream epdv1.DecodeService_DecodeClient, address string, cancel context.CancelFunc) {
	late := time.AfterFunc(statusAfterEnd, cancel)
	defer late.Stop()
	var err error
	for err == nil {
		_, err = stream.Recv()
	}
	if err != io.EOF {
		log.Printf("WARNING decode %s: no clean status after the last message (cancelled after %s without one): %v", address, statusAfterEnd, err)
	}
}

// releaseLeases frees leases no consumer will read, so they need not wait for their TTL.
func (p *pipeline) releaseLeases(leases map[string][]string) {
	for address, keys := range leases {
		conn := p.encoders.conn(address)
		if conn == nil {
			log.Printf("WARNING could not release the leases of %d calls on %s (it left the pool; they expire by TTL)", len(keys), address)
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), releaseTimeout)
		_, err := epdv1.NewEncoderServiceClient(conn).ReleaseEmbeddings(ctx, &epdv1.ReleaseEmbeddingsRequest{ReleaseKeys: keys})
		cancel()
		if err != nil {
			log.Printf("WARNING could not release the leases of %d calls on %s (they expire by TTL): %v", len(keys), address, err)
		}
	}
}

// releaseKv frees a prefill's KV that no decode will read, through any live decode instance,
// so it need not wait for the prefill's KV lease. Best effort: the lease still frees it.
func (p *pipeline) releaseKv(requestID string, handoff *epdv1.KvHandoff, avoid map[string]bool) {
	tried := map[string]bool{}
	for address := range avoid {
		tried[address] = true
	}
	problem := ""
	for i := 0; i < releaseAttempts; i++ {
		address, err := p.decodes.pick(tried)
		if err != nil {
			problem = err.message
			break
		}
		conn := p.decodes.conn(address)
		if conn == nil { // it left the pool since it was picked
			tried[address] = true
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), releaseTimeout)
		_, callErr := epdv1.NewDecodeServiceClient(conn).ReleaseKv(ctx, &epdv1.ReleaseKvRequest{RequestId: requestID, KvHandoff: handoff})
		cancel()
		if callErr == nil {
			return
		}
		problem = fmt.Sprintf("decode %s: %v", address, callErr)
		tried[address] = true
	}
	log.Printf("WARNING request %s: could not release its prefill KV (the prefill's KV lease frees it): %s", requestID, problem)
}
