package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"log"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/encoding/protowire"
)

// Traces: a SERVER span per gateway call that continues the caller's W3C trace context, and a
// CLIENT span per stage call whose context travels to the stage, so one request is one trace
// across every hop. Spans go to an OTLP/gRPC collector (--otlp-endpoint), as the Python services
// send theirs. OTLP's messages are written here with protowire: Debian's Go sources carry
// neither OpenTelemetry nor its protos.

type spanContext struct {
	traceID [16]byte
	spanID  [8]byte
	state   string // tracestate, passed on as it came
}

// parseTraceparent reads a W3C traceparent (version 00).
func parseTraceparent(value string) (spanContext, bool) {
	var sc spanContext
	fields := strings.Split(value, "-")
	if len(fields) != 4 || fields[0] != "00" || len(fields[1]) != 32 || len(fields[2]) != 16 {
		return sc, false
	}
	if _, err := hex.Decode(sc.traceID[:], []byte(fields[1])); err != nil || sc.traceID == [16]byte{} {
		return sc, false
	}
	if _, err := hex.Decode(sc.spanID[:], []byte(fields[2])); err != nil || sc.spanID == [8]byte{} {
		return sc, false
	}
	return sc, true
}

func (sc spanContext) traceparent() string {
	return "00-" + hex.EncodeToString(sc.traceID[:]) + "-" + hex.EncodeToString(sc.spanID[:]) + "-01"
}

const (
	spanKindServer = 2 // OTLP's SpanKind
	spanKindClient = 3
)

type span struct {
	context  spanContext
	parent   [8]byte // zero for a root
	name     string
	kind     uint64
	start    time.Time
	end      time.Time
	failed   bool
	message  string
	exporter *exporter
}

type spanKey struct{}

// startServerSpan starts the span of a call to this gateway, continuing the caller's trace.
func (e *exporter) startServerSpan(ctx context.Context, method string) (context.Context, *span) {
	s := &span{name: method, kind: spanKindServer, start: time.Now(), exporter: e}
	incoming, _ := metadata.FromIncomingContext(ctx)
	if parents := incoming.Get("traceparent"); len(parents) == 1 {
		if parent, ok := parseTraceparent(parents[0]); ok {
			s.context.traceID, s.parent = parent.traceID, parent.spanID
			if states := incoming.Get("tracestate"); len(states) == 1 {
				s.context.state = states[0]
			}
		}
	}
	if s.context.traceID == [16]byte{} {
		randomize(s.context.traceID[:])
	}
	randomize(s.context.spanID[:])
	return context.WithValue(ctx, spanKey{}, s), s
}

// startClientSpan starts the span of a call to a stage; the returned context carries it there.
func startClientSpan(ctx context.Context, name string) (context.Context, *span) {
	parent, _ := ctx.Value(spanKey{}).(*span)
	if parent == nil {
		return ctx, nil
	}
	s := &span{name: name, kind: spanKindClient, start: time.Now(), exporter: parent.exporter, parent: parent.context.spanID}
	s.context.traceID, s.context.state = parent.context.traceID, parent.context.state
	randomize(s.context.spanID[:])
	pairs := []string{"traceparent", s.context.traceparent()}
	if s.context.state != "" {
		pairs = append(pairs, "tracestate", s.context.state)
	}
	return metadata.AppendToOutgoingContext(ctx, pairs...), s
}

// finish ends the span with the call's outcome (nil: success) and queues it for export.
func (s *span) finish(err *requestError) {
	if s == nil {
		return
	}
	s.end = time.Now()
	if err != nil && err.code != codes.Canceled {
		s.failed, s.message = true, codeNames[err.code]+": "+err.message
	}
	s.exporter.queue(s)
}

func randomize(b []byte) {
	if _, err := rand.Read(b); err != nil {
		panic(err) // the OS's randomness is gone
	}
}

// ---- export --------------------------------------------------------------------------------

const (
	exportEvery     = time.Second
	exportBatch     = 512
	exportQueue     = 4096 // spans waiting; more are dropped (and counted in the log), never blocking a request
	exportTimeout   = 10 * time.Second
	exportServiceID = "gateway"
)

// exporter batches finished spans to an OTLP/gRPC collector. Without an endpoint it drops them:
// the trace context still reaches the stages.
type exporter struct {
	conn    *grpc.ClientConn
	spans   chan *span
	dropped int
	mu      sync.Mutex
	done    chan struct{}
}

func newExporter(endpoint string) (*exporter, error) {
	e := &exporter{}
	if endpoint == "" {
		return e, nil
	}
	for _, scheme := range []string{"http://", "grpc://"} {
		endpoint = strings.TrimPrefix(endpoint, scheme)
	}
	conn, err := grpc.Dial(endpoint, grpc.WithInsecure(), grpc.WithDefaultCallOptions(grpc.ForceCodec(rawCodec{})))
	if err != nil {
		return nil, err
	}
	e.conn, e.spans, e.done = conn, make(chan *span, exportQueue), make(chan struct{})
	go e.run()
	return e, nil
}

func (e *exporter) queue(s *span) {
	if e.spans == nil {
		return
	}
	select {
	case e.spans <- s:
	default:
		e.mu.Lock()
		e.dropped++
		e.mu.Unlock()
	}
}

// close sends what is queued, then stops.
func (e *exporter) close() {
	if e.spans == nil {
		return
	}
	close(e.spans)
	<-e.done
	e.conn.Close()
}

func (e *exporter) run() {
	defer close(e.done)
	ticker := time.NewTicker(exportEvery)
	defer ticker.Stop()
	var batch []*span
	for {
		select {
		case s, open := <-e.spans:
			if !open {
				e.export(batch)
				return
			}
			if batch = append(batch, s); len(batch) >= exportBatch {
				e.export(batch)
				batch = nil
			}
		case <-ticker.C:
			e.export(batch)
			batch = nil
		}
	}
}

func (e *exporter) export(batch []*span) {
	e.mu.Lock()
	dropped := e.dropped
	e.dropped = 0
	e.mu.Unlock()
	if dropped > 0 {
		log.Printf("WARNING %d spans dropped: the export queue was full", dropped)
	}
	if len(batch) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), exportTimeout)
	defer cancel()
	var reply []byte
	if err := e.conn.Invoke(ctx, "/opentelemetry.proto.collector.trace.v1.TraceService/Export", exportRequest(batch), &reply); err != nil {
		log.Printf("WARNING could not export %d spans: %v", len(batch), err)
	}
}

// exportRequest writes an ExportTraceServiceRequest: one resource (service.name), one scope.
func exportRequest(batch []*span) []byte {
	var spans []byte
	for _, s := range batch {
		spans = message(spans, 2, encodeSpan(s))
	}
	scope := message(nil, 1, protowire.AppendString(protowire.AppendTag(nil, 1, protowire.BytesType), "epd-gateway"))
	resource := message(nil, 1, keyValue("service.name", exportServiceID))
	resourceSpans := message(message(nil, 1, resource), 2, append(scope, spans...))
	return message(nil, 1, resourceSpans)
}

func encodeSpan(s *span) []byte {
	var b []byte
	b = bytesField(b, 1, s.context.traceID[:])
	b = bytesField(b, 2, s.context.spanID[:])
	if s.context.state != "" {
		b = bytesField(b, 3, []byte(s.context.state))
	}
	if s.parent != [8]byte{} {
		b = bytesField(b, 4, s.parent[:])
	}
	b = bytesField(b, 5, []byte(s.name))
	b = protowire.AppendVarint(protowire.AppendTag(b, 6, protowire.VarintType), s.kind)
	b = protowire.AppendFixed64(protowire.AppendTag(b, 7, protowire.Fixed64Type), uint64(s.start.UnixNano()))
	b = protowire.AppendFixed64(protowire.AppendTag(b, 8, protowire.Fixed64Type), uint64(s.end.UnixNano()))
	if s.failed { // Status{message = 2, code = 3: STATUS_CODE_ERROR = 2}
		status := bytesField(nil, 2, []byte(s.message))
		status = protowire.AppendVarint(protowire.AppendTag(status, 3, protowire.VarintType), 2)
		b = message(b, 15, status)
	}
	return b
}

func keyValue(key, value string) []byte {
	anyValue := bytesField(nil, 1, []byte(value)) // AnyValue.string_value
	return message(bytesField(nil, 1, []byte(key)), 2, anyValue)
}

func bytesField(b []byte, number protowire.Number, value []byte) []byte {
	return protowire.AppendBytes(protowire.AppendTag(b, number, protowire.BytesType), value)
}

func message(b []byte, number protowire.Number, body []byte) []byte {
	return bytesField(b, number, body)
}

// rawCodec passes already-encoded messages through gRPC (the collector's reply is ignored).
type rawCodec struct{}

func (rawCodec) Marshal(v interface{}) ([]byte, error) { return v.([]byte), nil }
func (rawCodec) Unmarshal(data []byte, v interface{}) error {
	*(v.(*[]byte)) = append([]byte(nil), data...)
	return nil
}
func (rawCodec) Name() string { return "proto" }

var _ encoding.Codec = rawCodec{}
