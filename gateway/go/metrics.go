package main

import (
	"fmt"
	"io"
	"math"
	"net/http"
	"sort"
	"strings"
	"sync"
)

// Prometheus metrics under the names and labels the Python services use (epd/telemetry.py),
// so dashboards and alerts do not care which gateway serves. The text exposition format is
// written here: Debian's Go sources carry no Prometheus client.

var latencyBuckets = []float64{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}

type family struct {
	name, help, kind string
	labels           []string
	buckets          []float64 // histograms only
	mu               sync.Mutex
	series           map[string]*series // by joined label values
}

type series struct {
	values []string
	value  float64  // counters and gauges
	counts []uint64 // histograms: per bucket, not cumulative
	sum    float64
	count  uint64
}

func newFamily(kind, name, help string, buckets []float64, labels ...string) *family {
	return &family{name: name, help: help, kind: kind, labels: labels, buckets: buckets, series: map[string]*series{}}
}

func (f *family) get(values []string) *series {
	key := strings.Join(values, "\x00")
	s := f.series[key]
	if s == nil {
		s = &series{values: values, counts: make([]uint64, len(f.buckets))}
		f.series[key] = s
	}
	return s
}

func (f *family) inc(values ...string) { f.add(1, values...) }

func (f *family) add(delta float64, values ...string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.get(values).value += delta
}

func (f *family) set(on bool, values ...string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	value := 0.0
	if on {
		value = 1
	}
	f.get(values).value = value
}

func (f *family) remove(values ...string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.series, strings.Join(values, "\x00"))
}

func (f *family) observe(value float64, values ...string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	s := f.get(values)
	if i := sort.SearchFloat64s(f.buckets, value); i < len(f.buckets) {
		s.counts[i]++
	}
	s.sum += value
	s.count++
}

func (f *family) write(w io.Writer) {
	f.mu.Lock()
	defer f.mu.Unlock()
	fmt.Fprintf(w, "# HELP %s %s\n# TYPE %s %s\n", f.name, f.help, f.name, f.kind)
	keys := make([]string, 0, len(f.series))
	for key := range f.series {
		keys = append(keys, key)
	}
	sort.Strings(keys)
	for _, key := range keys {
		s := f.series[key]
		labels := f.labelText(s.values, "")
		if f.kind != "histogram" {
			fmt.Fprintf(w, "%s%s %s\n", f.name, labels, number(s.value))
			continue
		}
		var cumulative uint64
		for i, bound := range f.buckets {
			cumulative += s.counts[i]
			fmt.Fprintf(w, "%s_bucket%s %d\n", f.name, f.labelText(s.values, number(bound)), cumulative)
		}
		fmt.Fprintf(w, "%s_bucket%s %d\n%s_sum%s %s\n%s_count%s %d\n", f.name, f.labelText(s.values, "+Inf"), s.count, f.name, labels, number(s.sum), f.name, labels, s.count)
	}
}

func (f *family) labelText(values []string, le string) string {
	pairs := make([]string, 0, len(values)+1)
	for i, name := range f.labels {
		pairs = append(pairs, fmt.Sprintf("%s=%q", name, values[i]))
	}
	if le != "" {
		pairs = append(pairs, fmt.Sprintf("le=%q", le))
	}
	if len(pairs) == 0 {
		return ""
	}
	return "{" + strings.Join(pairs, ",") + "}"
}

func number(value float64) string {
	if math.IsInf(value, 1) {
		return "+Inf"
	}
	return fmt.Sprint(value)
}

type metrics struct {
	requests, inFlight, stageSeconds, ttft, tpot, itl, e2el, gatewayOwn *family
	instanceUp, ejections, retries, localPrefills                       *family
}

func newMetrics() *metrics {
	return &metrics{
		requests:     newFamily("counter", "epd_requests_total", "RPCs handled, by service, method and status code", nil, "service", "method", "code"),
		inFlight:     newFamily("gauge", "epd_requests_in_flight", "Requests being served", nil, "service"),
		stageSeconds: newFamily("histogram", "epd_stage_seconds", "Time spent in each pipeline stage", latencyBuckets, "stage"),
		ttft:         newFamily("histogram", "epd_ttft_seconds", "Time to first token, seen by the gateway", latencyBuckets),
		tpot:         newFamily("histogram", "epd_tpot_seconds", "Mean time per output token after the first, per request", latencyBuckets),
		itl:          newFamily("histogram", "epd_itl_seconds", "Inter-token latency between streamed deltas", latencyBuckets),
		e2el:         newFamily("histogram", "epd_e2el_seconds", "End-to-end request latency, seen by the gateway", latencyBuckets),
		gatewayOwn: newFamily("histogram", "epd_gateway_own_seconds", "Per request, the gateway's time outside its stage calls (parsing, hashing, routing, retry back-off)",
			[]float64{0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1}),
		instanceUp:    newFamily("gauge", "epd_stage_instance_up", "1 while the gateway routes to a stage instance, 0 while it is down or ejected", nil, "stage", "address"),
		ejections:     newFamily("counter", "epd_stage_ejections_total", "Stage instances taken out of the gateway's rotation after a failed call", nil, "stage"),
		retries:       newFamily("counter", "epd_gateway_retries_total", "Requests retried on other instances after a stage failed before the first token", nil, "stage"),
		localPrefills: newFamily("counter", "epd_gateway_local_prefills_total", "E/P/D requests a decode instance prefilled itself, no prefill instance being live (--local-prefill-fallback)", nil),
	}
}

func (m *metrics) ServeHTTP(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	for _, f := range []*family{m.requests, m.inFlight, m.stageSeconds, m.ttft, m.tpot, m.itl, m.e2el, m.gatewayOwn, m.instanceUp, m.ejections, m.retries, m.localPrefills} {
		f.write(w)
	}
}
