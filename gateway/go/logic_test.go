package main

// Pure logic only (routing, field paths, validation); the data path is tested end to end
// against real stages by the Python suite (tests/, the epd-go gateways).

import (
	"context"
	"math"
	"reflect"
	"sync"
	"testing"
	"time"

	epdv1 "epd/sdk/go/epd/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
)

func keys(count int) []uint64 {
	out := make([]uint64, count)
	state := uint64(1)
	for i := range out { // splitmix64: spread keys, as the MAC's are
		state += 0x9e3779b97f4a7c15
		z := state
		z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
		z = (z ^ (z >> 27)) * 0x94d049bb133111eb
		out[i] = z ^ (z >> 31)
	}
	return out
}

func members(addresses ...string) []*instance {
	out := make([]*instance, len(addresses))
	for i, address := range addresses {
		out[i] = &instance{address: address, health: healthServing}
	}
	return out
}

func TestTheRingSpreadsKeysAndALeavingInstanceMovesOnlyItsOwn(t *testing.T) {
	all := newHashRing(members("a:1", "b:1", "c:1"))
	fewer := newHashRing(members("a:1", "c:1"))
	share := map[string]int{}
	for _, key := range keys(30000) {
		owner := all.owner(key)
		share[owner]++
		if walk := all.walk(key); walk[0] != owner || len(walk) != 3 {
			t.Fatalf("walk %v does not start at the owner %s", walk, owner)
		}
		if owner != "b:1" && fewer.owner(key) != owner {
			t.Fatalf("key %d moved from %s though %s stayed", key, owner, owner)
		}
	}
	for address, count := range share {
		if count < 7000 || count > 13000 { // a third is 10000
			t.Errorf("%s owns %d of 30000 keys", address, count)
		}
	}
}

func testPool(addresses ...string) *pool {
	p := &pool{stage: "encoder", affinity: true, instances: map[string]*instance{}, holders: newHolderCache(8), metrics: newMetrics(), ctx: context.Background()}
	for _, in := range members(addresses...) {
		p.instances[in.address], p.order = in, append(p.order, in.address)
	}
	p.ring = newHashRing(p.membersLocked())
	return p
}

func TestAHotKeySpillsAlongTheRingAndAHolderKeepsItPastTheBound(t *testing.T) {
	p := testPool("a:1", "b:1", "c:1")
	key := keys(1)[0]
	walk := p.ring.walk(key)
	if got, _ := p.pickForKey(key, nil); got != walk[0] {
		t.Fatalf("an idle ring picked %s, not the owner %s", got, walk[0])
	}
	p.instances[walk[0]].inFlight = 2 // the bound for one more call over three idle-ish instances is ceil(1.25*3/3) = 2
	if got, _ := p.pickForKey(key, nil); got != walk[1] {
		t.Fatalf("an owner over the bound should spill to %s, got %s", walk[1], got)
	}
	p.recordHolder(key, walk[0])
	if got, _ := p.pickForKey(key, nil); got != walk[0] {
		t.Fatalf("the recorded holder %s should take its key past the bound, got %s", walk[0], got)
	}
	if got, _ := p.pickForKey(key, map[string]bool{walk[0]: true}); got == walk[0] {
		t.Fatalf("an instance to avoid was picked while others are live")
	}
	p.instances[walk[0]].health = healthDown
	if got, _ := p.pickForKey(key, nil); got == walk[0] {
		t.Fatalf("a down instance was picked")
	}
}

func TestPickStartsAtTheFirstInstanceAndRotatesTies(t *testing.T) {
	p := testPool("a:1", "b:1")
	var picked []string
	for i := 0; i < 4; i++ {
		address, _ := p.pick(nil)
		picked = append(picked, address)
	}
	if want := []string{"a:1", "b:1", "a:1", "b:1"}; !reflect.DeepEqual(picked, want) {
		t.Fatalf("picked %v, want %v", picked, want)
	}
	for _, in := range p.instances {
		in.health = healthDown
	}
	if _, err := p.pick(nil); err == nil || err.code != codes.Unavailable {
		t.Fatalf("no live instance should be UNAVAILABLE, got %v", err)
	}
}

func TestTheHolderCacheForgetsTheLeastRecentlyRecorded(t *testing.T) {
	c := newHolderCache(2)
	c.put(1, holder{"a", "a"})
	c.put(2, holder{"b", "b"})
	c.put(1, holder{"c", "c"}) // 1 is the most recent now
	c.put(3, holder{"d", "d"})
	if _, ok := c.get(2); ok {
		t.Fatal("key 2 should have been evicted")
	}
	if h, ok := c.get(1); !ok || h.address != "c" {
		t.Fatalf("key 1 should hold its latest holder, got %v %v", h, ok)
	}
}

func TestStageFieldPathsBecomeThePublicRequests(t *testing.T) {
	encoder := &requestError{code: codes.InvalidArgument, violations: []violation{{"items[1].image.data", "undecodable"}, {"items", "too many"}}}
	got := remapItemFields(encoder, []string{"messages[0].parts[0]", "messages[1].parts[2]"})
	want := []violation{{"messages[1].parts[2].image.data", "undecodable"}, {"messages", "too many"}}
	if !reflect.DeepEqual(got.violations, want) || got.message != "invalid media: messages[1].parts[2].image.data undecodable; messages too many" {
		t.Fatalf("got %v %q", got.violations, got.message)
	}
	engine := &requestError{code: codes.InvalidArgument, violations: []violation{{"prompt.chat", "over the context"}, {"sampling.top_p", "bad"}}}
	if got := enginePromptError(nil, "", engine).violations; !reflect.DeepEqual(got, []violation{{"messages", "over the context"}, {"sampling.top_p", "bad"}}) {
		t.Fatalf("got %v", got)
	}
}

func TestAStageThatCannotRenderChatsIsEjectedAndTheRequestRetried(t *testing.T) {
	p := testPool("a:1")
	conn, err := grpc.Dial("127.0.0.1:1", grpc.WithInsecure()) // nothing listens: the health check fails
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	p.instances["a:1"].conn = conn
	old := &requestError{code: codes.InvalidArgument, violations: []violation{{"prompt.token_ids", "are required"}}}
	got := enginePromptError(p, "a:1", old)
	if got.code != codes.Unavailable || !got.stageFailed() || !reflect.DeepEqual(got.suspects, []string{"a:1"}) {
		t.Fatalf("got %+v", got)
	}
	if p.instances["a:1"].health != healthDown {
		t.Fatal("the instance was not ejected")
	}
}

func TestBadRequestsNameEveryFieldAtOnce(t *testing.T) {
	nan := float32(math.NaN())
	request := &epdv1.GenerateRequest{
		Messages: []*epdv1.ChatMessage{{Role: 9, Parts: []*epdv1.ContentPart{
			{},
			{Content: &epdv1.ContentPart_Video{Video: &epdv1.Video{Source: &epdv1.Video_Frames{Frames: &epdv1.VideoFrames{Fps: 1e-300}}}}},
		}}},
		Sampling: &epdv1.SamplingParams{MaxTokens: 4, Temperature: &nan},
	}
	_, err := parseRequest(request, mediaLimits{maxItemBytes: 1 << 20, maxRequestBytes: 1 << 20}, 0)
	var fields []string
	for _, v := range err.violations {
		fields = append(fields, v.field)
	}
	want := []string{"messages[0].role", "messages[0].parts[0]", "messages[0].parts[1].video.frames.frames", "messages[0].parts[1].video.frames.fps", "sampling.temperature"}
	if err.code != codes.InvalidArgument || !reflect.DeepEqual(fields, want) {
		t.Fatalf("got %v: %v", err.code, fields)
	}
	text := &epdv1.GenerateRequest{
		Messages: []*epdv1.ChatMessage{{Parts: []*epdv1.ContentPart{
			{Content: &epdv1.ContentPart_Image{Image: &epdv1.Media{Data: []byte{1}, MimeType: "image/tiff"}}},
			{Content: &epdv1.ContentPart_Text{Text: "twelve bytes"}},
		}}},
		Sampling: &epdv1.SamplingParams{MaxTokens: 4},
	}
	if _, err := parseRequest(text, mediaLimits{maxItemBytes: 1, maxRequestBytes: 1}, 0); err == nil || err.violations[0].description != "unsupported MIME type 'image/tiff'; accepted: image/bmp, image/gif, image/jpeg, image/jpg, image/png, image/webp" {
		t.Fatalf("got %+v", err)
	}
	text.Messages[0].Parts = text.Messages[0].Parts[1:]
	if _, err := parseRequest(text, mediaLimits{maxItemBytes: 1, maxRequestBytes: 1}, 11); err == nil || err.violations[0].field != "messages" {
		t.Fatalf("twelve bytes of text over an 11-byte limit: got %+v", err)
	}
}

func TestCallCountWaitsForEveryCallAndMayRiseFromZeroWhileWaitedOn(t *testing.T) {
	c := newCallCount()
	c.wait() // no call: at once
	c.add(1)
	drained := make(chan struct{})
	go func() { c.wait(); close(drained) }()
	select {
	case <-drained:
		t.Fatalf("wait returned while a call ran")
	case <-time.After(20 * time.Millisecond):
	}
	c.add(-1)
	select {
	case <-drained:
	case <-time.After(time.Second):
		t.Fatalf("wait did not return once the call ended")
	}
	// Calls starting from zero while drains wait (a sync.WaitGroup panics on this).
	var wg sync.WaitGroup
	for i := 0; i < 8; i++ {
		wg.Add(2)
		go func() {
			defer wg.Done()
			for k := 0; k < 2000; k++ {
				c.add(1)
				c.add(-1)
			}
		}()
		go func() {
			defer wg.Done()
			for k := 0; k < 200; k++ {
				c.wait()
			}
		}()
	}
	wg.Wait()
	c.wait()
}
