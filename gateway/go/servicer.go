package main

import (
	"context"
	"crypto/subtle"
	"log"
	"strings"
	"sync"
	"time"

	epdv1 "epd/sdk/go/epd/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// gatewayServicer: GatewayService. Parse the public request, run the pipeline, stream it back.
type gatewayServicer struct {
	epdv1.UnimplementedGatewayServiceServer
	pipeline *pipeline
	metrics  *metrics
	traces   *exporter
	mu       sync.Mutex
	inFlight map[string]*run
	calls    *callCount // every call being handled: draining waits for them
}

// callCount counts the calls being handled and the pipelines winding down after them. Unlike a
// sync.WaitGroup it may rise from zero while a drain waits on it (a call grpc-go dispatched as
// the drain began), where a WaitGroup panics.
type callCount struct {
	mu   sync.Mutex
	n    int
	idle *sync.Cond
}

func newCallCount() *callCount {
	c := &callCount{}
	c.idle = sync.NewCond(&c.mu)
	return c
}

func (c *callCount) add(delta int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n += delta; c.n == 0 {
		c.idle.Broadcast()
	}
}

// wait returns once no call is being handled.
func (c *callCount) wait() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for c.n > 0 {
		c.idle.Wait()
	}
}

// run: one Generate call, as Abort finds it.
type run struct {
	cancel   context.CancelFunc // stops its pipeline
	aborted  bool
	finished bool // its Finished message went out: an Abort now changes nothing
}

func (s *gatewayServicer) Generate(msg *epdv1.GenerateRequest, stream epdv1.GatewayService_GenerateServer) error {
	c := &clock{m: s.metrics, start: time.Now()}
	return s.handle(stream.Context(), "Generate", func(ctx context.Context) *requestError {
		r, err := parseRequest(msg, s.pipeline.limits, s.pipeline.maxPromptBytes)
		if err != nil {
			return err
		}
		pipelineCtx, cancel := detach(ctx)
		current := &run{cancel: cancel}
		s.mu.Lock()
		if s.inFlight[r.id] != nil {
			s.mu.Unlock()
			cancel()
			return newError(codes.AlreadyExists, "request_id %s is already in flight", pyRepr(r.id))
		}
		s.inFlight[r.id] = current
		s.mu.Unlock()
		defer func() {
			s.mu.Lock()
			delete(s.inFlight, r.id)
			s.mu.Unlock()
		}()
		out := newOutbox()
		ended := make(chan struct{})
		s.calls.add(1) // it may wind down after this call returns: draining waits for it too
		go func() {
			defer s.calls.add(-1)
			defer close(ended)
			defer cancel()
			out.end(s.pipeline.generate(pipelineCtx, r, c, out.put))
		}()
		// Leaving before the Finished message (the client went away, or could not be written to)
		// stops the pipeline, and waits for its clean-up: leases and KV released.
		stop := func() {
			cancel()
			<-ended
		}
		for {
			responses, done, failure := out.take(ctx)
			if ctx.Err() != nil {
				stop()
				return newError(codes.Canceled, "the client went away")
			}
			for _, response := range responses {
				if response.GetFinished() != nil {
					s.mu.Lock()
					current.finished = true
					s.mu.Unlock()
				}
				if err := stream.Send(response); err != nil {
					stop()
					return newError(codes.Canceled, "the client stopped reading: %v", err)
				}
				if response.GetFinished() != nil {
					return nil // the reply is complete; the pipeline winds down on its own
				}
			}
			if !done {
				continue
			}
			s.mu.Lock()
			aborted := current.aborted
			s.mu.Unlock()
			if failure != nil && aborted {
				// Ended by Abort: the stream still reports what was done.
				finished := c.finished(epdv1.FinishReason_FINISH_REASON_ABORT)
				if err := stream.Send(&epdv1.GenerateResponse{Event: &epdv1.GenerateResponse_Finished{Finished: finished}}); err != nil {
					return newError(codes.Canceled, "the client stopped reading: %v", err)
				}
				return nil
			}
			return failure
		}
	})
}

func (s *gatewayServicer) Abort(ctx context.Context, msg *epdv1.AbortRequest) (*epdv1.AbortResponse, error) {
	var response *epdv1.AbortResponse
	err := s.handle(ctx, "Abort", func(context.Context) *requestError {
		if msg.GetRequestId() == "" {
			return fieldError("request_id", "is required")
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		current := s.inFlight[msg.GetRequestId()]
		if current == nil {
			return newError(codes.NotFound, "no in-flight request with id %s", pyRepr(msg.GetRequestId()))
		}
		if !current.finished {
			current.aborted = true
			current.cancel()
		}
		response = &epdv1.AbortResponse{}
		return nil
	})
	return response, err
}

// handle runs a call in its SERVER span, counts it by its outcome and turns a failure into its
// rich status.
func (s *gatewayServicer) handle(ctx context.Context, method string, body func(context.Context) *requestError) error {
	s.calls.add(1)
	defer s.calls.add(-1)
	s.metrics.inFlight.add(1, "gateway")
	defer s.metrics.inFlight.add(-1, "gateway")
	ctx, serverSpan := s.traces.startServerSpan(ctx, "/epd.v1.GatewayService/"+method)
	err := body(ctx)
	serverSpan.finish(err)
	if err == nil {
		s.metrics.requests.inc("gateway", method, "OK")
		return nil
	}
	if err.code != codes.Canceled {
		log.Printf("INFO gateway.%s failed: %s %s", method, codeNames[err.code], err.message)
	}
	s.metrics.requests.inc("gateway", method, codeNames[err.code])
	return err.status().Err()
}

// ---- bearer token --------------------------------------------------------------------------

// Probes and tooling reach these without a token (Kubernetes, grpc_health_probe, grpcurl).
var openMethodPrefixes = []string{"/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/", "/grpc.reflection.v1.ServerReflection/"}

// bearerToken lets a call through only with "authorization: Bearer <token>", compared in a
// time that does not depend on where a wrong token differs; health and reflection stay open.
type bearerToken struct{ expected []byte }

func (b bearerToken) check(ctx context.Context, method string) error {
	for _, prefix := range openMethodPrefixes {
		if strings.HasPrefix(method, prefix) {
			return nil
		}
	}
	md, _ := metadata.FromIncomingContext(ctx)
	presented := md.Get("authorization")
	if len(presented) == 1 && subtle.ConstantTimeCompare([]byte(presented[0]), b.expected) == 1 {
		return nil
	}
	if len(presented) == 0 {
		return status.Error(codes.Unauthenticated, "missing 'authorization: Bearer <token>' metadata")
	}
	return status.Error(codes.Unauthenticated, "invalid bearer token")
}

func (b bearerToken) unary(ctx context.Context, req interface{}, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (interface{}, error) {
	if err := b.check(ctx, info.FullMethod); err != nil {
		return nil, err
	}
	return handler(ctx, req)
}

func (b bearerToken) stream(srv interface{}, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	if err := b.check(ss.Context(), info.FullMethod); err != nil {
		return err
	}
	return handler(srv, ss)
}
