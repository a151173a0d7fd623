package main

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	epdv1 "github.com/epd-project/epd/sdk/go/epd/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// record is one request as the client saw it, plus the gateway's own stage timings (the
// fields of bench/workload.py's RequestRecord).
type record struct {
	OK           bool               `json:"ok"`
	Error        string             `json:"error"`
	TokenIDs     []uint32           `json:"token_ids"`
	TTFT         float64            `json:"ttft_s"`
	E2EL         float64            `json:"e2el_s"`
	ITL          []float64          `json:"itl_s"`
	Stages       map[string]float64 `json:"stages_s"`
	GatewayTotal float64            `json:"gateway_total_s"`
}

const loadCallTimeout = 600 * time.Second

// runLoad is the serving experiments' client, compiled: it sends the requests in requestsPath
// (each a GenerateRequest, after its length as a 4-byte big-endian number) to target, request i
// at offsets[i] seconds from the start ("" sends them all at once, in order), at most
// maxConcurrency in flight (0: no limit; arrivals wait for a slot, in order, and their latency
// counts from the send), and prints one JSON list of records, in request order.
//
// A grpc.aio client spends Python on every message it sends and reads: on these 2-core hosts
// about 3 % of a request's latency, charged to whichever server it talks to. Compiled, the
// client's share is the same small one for every arm.
func runLoad(target, requestsPath, offsetsCSV string, maxConcurrency int) error {
	requests, err := readRequests(requestsPath)
	if err != nil {
		return err
	}
	offsets := make([]time.Duration, len(requests))
	if offsetsCSV != "" {
		fields := strings.Split(offsetsCSV, ",")
		if len(fields) != len(requests) {
			return fmt.Errorf("%d offsets for %d requests", len(fields), len(requests))
		}
		for i, field := range fields {
			seconds, err := strconv.ParseFloat(field, 64)
			if err != nil {
				return err
			}
			offsets[i] = time.Duration(seconds * float64(time.Second))
		}
	}
	conn, err := grpc.Dial(target, grpc.WithInsecure(),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64<<20), grpc.MaxCallSendMsgSize(64<<20)))
	if err != nil {
		return err
	}
	defer conn.Close()
	client := epdv1.NewGatewayServiceClient(conn)
	records := make([]record, len(requests))
	var slots chan struct{}
	if maxConcurrency > 0 {
		slots = make(chan struct{}, maxConcurrency)
	}
	begin := time.Now().Add(50 * time.Millisecond)
	var wg sync.WaitGroup
	for i, request := range requests {
		time.Sleep(time.Until(begin.Add(offsets[i])))
		if slots != nil {
			slots <- struct{}{}
		}
		wg.Add(1)
		go func(i int, request *epdv1.GenerateRequest) {
			defer wg.Done()
			records[i] = send(client, request)
			if slots != nil {
				<-slots
			}
		}(i, request)
	}
	wg.Wait()
	return json.NewEncoder(os.Stdout).Encode(records)
}

func readRequests(path string) ([]*epdv1.GenerateRequest, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var requests []*epdv1.GenerateRequest
	for len(data) > 0 {
		if len(data) < 4 || int(binary.BigEndian.Uint32(data)) > len(data)-4 {
			return nil, fmt.Errorf("%s: truncated", path)
		}
		size := binary.BigEndian.Uint32(data)
		request := &epdv1.GenerateRequest{}
		if err := proto.Unmarshal(data[4:4+size], request); err != nil {
			return nil, err
		}
		requests = append(requests, request)
		data = data[4+size:]
	}
	return requests, nil
}

func send(client epdv1.GatewayServiceClient, request *epdv1.GenerateRequest) record {
	ctx, cancel := context.WithTimeout(context.Background(), loadCallTimeout)
	defer cancel()
	sent := time.Now()
	failed := func(err error) record {
		s := status.Convert(err)
		return record{Error: fmt.Sprintf("%s: %s", codeName(s.Code()), s.Message())}
	}
	stream, err := client.Generate(ctx, request)
	if err != nil {
		return failed(err)
	}
	r := record{Stages: map[string]float64{}}
	var stamps []time.Time
	for {
		response, err := stream.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			return failed(err)
		}
		if delta := response.GetDelta(); delta != nil {
			r.TokenIDs = append(r.TokenIDs, delta.GetTokenIds()...)
			stamps = append(stamps, time.Now())
		} else if timings := response.GetFinished().GetTimings(); timings != nil {
			r.Stages["encode"] = timings.GetEncode().AsDuration().Seconds()
			r.Stages["prefill"] = timings.GetPrefill().AsDuration().Seconds()
			r.Stages["decode"] = timings.GetDecode().AsDuration().Seconds()
			r.GatewayTotal = timings.GetTotal().AsDuration().Seconds()
		}
	}
	done := time.Now()
	if len(stamps) == 0 {
		return record{Error: "no tokens"}
	}
	r.OK, r.TTFT, r.E2EL = true, stamps[0].Sub(sent).Seconds(), done.Sub(sent).Seconds()
	for k := 1; k < len(stamps); k++ {
		r.ITL = append(r.ITL, stamps[k].Sub(stamps[k-1]).Seconds())
	}
	return r
}

// codeName: a status code as Python's grpc names it (UNAVAILABLE, DEADLINE_EXCEEDED), so both
// clients report errors alike.
func codeName(code codes.Code) string {
	var name strings.Builder
	for i, r := range code.String() {
		if i > 0 && r >= 'A' && r <= 'Z' {
			name.WriteByte('_')
		}
		name.WriteRune(r)
	}
	return (strings.Replace(strings.ToUpper(name.String()), "CANCELED", "CANCELLED", 1))
}
