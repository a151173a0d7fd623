package main

import (
	"context"
	"sync"
	"time"

	epdv1 "epd/sdk/go/epd/v1"
)

// One request's pipeline runs in its own goroutine; the Generate handler streams what it
// produces. Deltas the handler has not yet sent are merged into one, as vLLM's
// RequestOutputCollector does: a client that reads slower than the decode produces gets fewer,
// larger messages instead of a backlog, and the decode's stream is read at its own pace.
//
// The handler's stream ends with the Finished message, not with the pipeline: what the pipeline
// still does after it (reading the decode call to its status) is no part of the reply, so it
// runs on, detached from the client's call, whose end would otherwise cancel it.

// outbox holds what the pipeline produced and the handler has not sent yet.
type outbox struct {
	mu      sync.Mutex
	pending []*epdv1.GenerateResponse
	ended   bool
	failure *requestError
	ready   chan struct{} // signalled (capacity 1) on every change
}

func newOutbox() *outbox { return &outbox{ready: make(chan struct{}, 1)} }

func (o *outbox) signal() {
	select {
	case o.ready <- struct{}{}:
	default:
	}
}

// put queues a message, merging a delta into a delta still waiting.
func (o *outbox) put(response *epdv1.GenerateResponse) {
	o.mu.Lock()
	if delta := response.GetDelta(); delta != nil && len(o.pending) > 0 {
		if last := o.pending[len(o.pending)-1].GetDelta(); last != nil {
			last.TokenIds = append(last.TokenIds, delta.GetTokenIds()...)
			last.Text += delta.GetText()
			o.mu.Unlock()
			o.signal()
			return
		}
	}
	o.pending = append(o.pending, response)
	o.mu.Unlock()
	o.signal()
}

// end records that the pipeline is done, and how.
func (o *outbox) end(failure *requestError) {
	o.mu.Lock()
	o.ended, o.failure = true, failure
	o.mu.Unlock()
	o.signal()
}

// take waits for messages or the end: the messages queued since the last take, and, once the
// pipeline is done and nothing is left, ended and its failure.
func (o *outbox) take(ctx context.Context) ([]*epdv1.GenerateResponse, bool, *requestError) {
	for {
		o.mu.Lock()
		if len(o.pending) > 0 || o.ended {
			taken, ended, failure := o.pending, o.ended && len(o.pending) == 0, o.failure
			o.pending = nil
			o.mu.Unlock()
			return taken, ended, failure
		}
		o.mu.Unlock()
		select {
		case <-o.ready:
		case <-ctx.Done():
			return nil, false, nil
		}
	}
}

// detached carries a context's values (its trace span) and deadline, but not its cancellation:
// the pipeline outlives the client's call once the reply is complete. (context.WithoutCancel
// came in Go 1.21; Debian's is 1.19.)
type detached struct{ parent context.Context }

func (d detached) Deadline() (time.Time, bool)       { return time.Time{}, false }
func (d detached) Done() <-chan struct{}             { return nil }
func (d detached) Err() error                        { return nil }
func (d detached) Value(key interface{}) interface{} { return d.parent.Value(key) }

func detach(ctx context.Context) (context.Context, context.CancelFunc) {
	if deadline, ok := ctx.Deadline(); ok {
		return context.WithDeadline(detached{ctx}, deadline)
	}
	return context.WithCancel(detached{ctx})
}
